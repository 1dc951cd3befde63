"""The prefill's launch plans, one per call signature: the serial path (K1 then K2, ``_SerialPlan``),
the fused kernel (``_FusedPlan``), the intracard-CP chain (K1, pre_scan, merge, segmented K2,
``_CPPlan``) and the certified-truncation pieces (the fused kernel over a piece table,
``_FusedPiecesPlan``; or K1, tile bounds, segmented K2 walking them, ``_PiecesPlan``), with what
they launch: the kernels' launch templates and static values, the K2 /
merge flag bits, the CP segment tables, and each call's checks, allocations and launches.
"""

import dataclasses

import torch

from .. import layout
from ..layout import (
    FLAG_BF16_FINAL,
    FLAG_BF16_INIT,
    FLAG_FINAL_STATE,
    FLAG_IDENTITY_INIT,
    FLAG_INDEXED_FINAL,
    FLAG_INDEXED_INIT,
    FLAG_INITIAL_STATE,
    FLAG_LONGEST_FIRST,
    FLAG_NO_OUTPUT,
    FLAG_STATUS,
    FLAG_VARLEN,
    FLAG_ZERO_V,
    FLAG_SUCCESSOR,
    SEG_PREDECESSOR,
    SEGMENT_FIELDS,
    WORKSPACE_RECORD_BYTES,
    D,
)
from ..runtime.driver import zero_words as _zero_words
from ..runtime.loader import raw_stream as _raw_stream
from ..specs import (
    WORKSPACE_POINTERS,
    K1Spec,
    MergeSpec,
    TileBoundSpec,
    fused_pieces_spec,
    fused_spec,
    k1_grid,
    merge_v_block,
    segmented_k2_spec,
    segmented_v_block,
    serial_k2_spec,
    tile_bound_grid,
)
from .call import PrefillCall
from .checks import check_scalars, fail, host_cu_seqlens
from .paths import Path
from .prefill_checks import NO_CHECKPOINTS, Checked, CheckpointPlan, check_addresses
from . import cp_plan, prepare
from .prepare import input_geometry, plan_slots
from .workspace import ARENA, SEGMENT_TABLES

# The serial K2's grid order: varlen sequences longest first, so the longest chains start in the
# first wave (a fixed-length kernel ignores the bit; PERFORMANCE.md, K2 recurrence).  The fused
# kernel takes the same bit.
SERIAL_K2_ORDER = FLAG_LONGEST_FIRST


def _segment_row(seg, seq_first_token, init_index, final_index, flags) -> list[int]:
    row = [0] * layout.SEGMENT_FIELDS
    row[layout.SEG_SEQ], row[layout.SEG_FIRST_TOKEN], row[layout.SEG_FIRST_SLOT] = (
        seg.seq,
        seg.first_token,
        seg.first_slot,
    )
    row[layout.SEG_TOKENS], row[layout.SEG_INIT_INDEX], row[layout.SEG_FINAL_INDEX] = (
        seg.num_tokens,
        init_index,
        final_index,
    )
    row[layout.SEG_FLAGS], row[layout.SEG_SEQ_OFFSET] = flags, seg.first_token - seq_first_token
    return row


def _segment_tables(segments, init_flags: int, final_flags: int):
    """Rows of the pre_scan jobs and of the segmented recurrence, and each sequence's segment
    range.  Pre_scan job 2i (2i + 1) writes M_i (B_i) of segment i, for every segment but each
    sequence's last; a sequence's first segment has job 2i + 1 only, run from the user's initial
    state (``init_flags``; 0: none) rather than from 0, so its B_i is the next segment's start
    state and the merge takes it as is.  Segment i of the recurrence starts from carries[i]; a
    sequence's last segment writes the user's final state with ``final_flags`` (0: no final
    state)."""
    transition = FLAG_IDENTITY_INIT | FLAG_ZERO_V | FLAG_NO_OUTPUT | FLAG_FINAL_STATE
    prescan_rows, main_rows, bounds = [], [], [0]
    for seq_segments in segments:
        start = seq_segments[0].first_token
        for n, seg in enumerate(seq_segments):
            index = len(main_rows)
            last = n + 1 == len(seq_segments)
            if not last:
                if n == 0:
                    prescan_rows.append(
                        _segment_row(seg, start, seg.seq, 2 * index + 1, init_flags | FLAG_NO_OUTPUT | FLAG_FINAL_STATE)
                    )
                else:
                    prescan_rows.append(_segment_row(seg, start, -1, 2 * index, transition))
                    prescan_rows.append(_segment_row(seg, start, -1, 2 * index + 1, FLAG_NO_OUTPUT | FLAG_FINAL_STATE))
            main_rows.append(
                _segment_row(seg, start, index, seg.seq, FLAG_INITIAL_STATE | (final_flags if last else 0))
            )
        bounds.append(len(main_rows))
    return prescan_rows, main_rows, bounds


def prescan_jobs(segments) -> int:
    """The pre_scan rows of a segment plan (``_segment_tables``): one for a split sequence's first
    segment, two for each of its middle ones."""
    return sum(2 * len(seq) - 3 for seq in segments if len(seq) > 1)


def _state_flags(state, which: str, indexed: bool) -> int:
    """K2 / merge flag bits for a user state tensor (``which`` = "init" or "final")."""
    if state is None:
        return 0
    present, pooled, bf16 = {
        "init": (FLAG_INITIAL_STATE, FLAG_INDEXED_INIT, FLAG_BF16_INIT),
        "final": (FLAG_FINAL_STATE, FLAG_INDEXED_FINAL, FLAG_BF16_FINAL),
    }[which]
    return present | (pooled if indexed else 0) | (bf16 if state.dtype == torch.bfloat16 else 0)


def _checkpoint_values(checkpoints: CheckpointPlan, state_layout: str) -> dict:
    """The checkpoint parameters' static values (``specs.abi.CHECKPOINT_PARAMS``; the pointers are
    per call): none when ``checkpoints.every`` is 0."""
    stride_k, stride_v = (1, D) if state_layout == "vk" else (D, 1)
    return {
        "checkpoint_every": checkpoints.every,
        "checkpoint_columns": checkpoints.columns,
        "checkpoint_slots": checkpoints.slots,
        "checkpoint_slot_stride": checkpoints.slot_stride,
        "checkpoint_stride_k": stride_k,
        "checkpoint_stride_v": stride_v,
    }


_WORKSPACES = tuple(p.name for p in WORKSPACE_POINTERS)
# Every launch after K1 is a programmatic dependent of the one before it (K1 → K2, or K1 →
# pre_scan → merge → segmented K2): its CTAs start while the previous grid drains and wait for
# its end before reading its output (``griddepcontrol``; see ``LoadedKernel.launch_packed``).
DEPENDENT_LAUNCH = True


def make_plan(call: PrefillCall, c: Checked, path: Path, loader, device):
    """The launch plan of a validated call (``c``) on ``path`` (``paths.choose_path``), every
    kernel resolved first: a missing cubin fails before anything launches.  A call that reaches
    no checkpoint (``Path.reached``) runs the plain kernels."""
    varlen = call.cu_seqlens is not None
    if path.reached is False:
        c = dataclasses.replace(c, checkpoints=NO_CHECKPOINTS)  # the checkpoint tensors were checked
    checkpointing = c.checkpoints.every > 0
    if path.kind == "fused":
        return _FusedPlan(call, c, path, loader.get(device, fused_spec(call.inputs.gate.name, checkpointing)), device)
    if path.kind == "fused_pieces":
        return _FusedPiecesPlan(call, c, path, loader.get(device, fused_pieces_spec(call.inputs.gate.name)), device)
    k1 = loader.get(device, K1Spec(varlen=varlen, gate=call.inputs.gate.name))
    if path.kind == "cp":
        return _CPPlan(call, c, path, loader, k1, device)
    if path.kind == "pieces":
        return _PiecesPlan(call, c, path, loader, k1, device)
    k2 = loader.get(device, serial_k2_spec(varlen, path.v_block, checkpointing))
    return _SerialPlan(call, c, path, k1, k2, device)


class _Plan:
    """A launch recipe for one call signature (shapes, strides, dtypes, devices and options),
    immutable once built: the validated facts, the state flag bits, K1's launch template (none
    on the fused path), what the plan cache reads to pick a call's plan (``split``,
    ``lengths_uniform``, ``checkpoint_reach``: ``paths.Path``), and the per-call checks and
    allocations the signature does not fix (addresses, scalars, host cu_seqlens values)."""

    serial = True

    def __init__(self, call: PrefillCall, c: Checked, path: Path, k1, device):
        self.c, self.device = c, device
        self.split, self.lengths_uniform, self.checkpoint_reach = (
            path.split,
            path.lengths_uniform,
            path.checkpoint_reach,
        )
        # A final state is wanted but not given: each call allocates one (plain fp32, N packed slots).
        indexed = call.state_indices is not None
        self.alloc_final = (call.output_final_state or call.final_state is not None) and call.final_state is None
        self.init_flags = _state_flags(call.initial_state, "init", indexed)
        self.final_flags = FLAG_FINAL_STATE if self.alloc_final else _state_flags(call.final_state, "final", indexed)
        self.status_flag = 0 if call.status is None else FLAG_STATUS
        self.state_layout = call.state_layout
        total_slots = plan_slots(c.batch, c.seq_len, call.cu_seqlens)
        # The fused path (k1 None) has no workspaces.
        self.slots = 0 if k1 is None else c.heads * total_slots
        self.geometry = {"seq_len": c.seq_len, "num_seqs": c.num_seqs, "total_slots": total_slots, "heads": c.heads}
        if k1 is not None:
            self.k1 = k1.template(
                {
                    **self.geometry,
                    **input_geometry(c.batch, c.seq_len, c.heads, c.strides),
                    **k1_grid(total_slots, c.heads, prepare.sm_count(device)),
                    "flags": call.inputs.conventions,
                }
            )

    @property
    def length_facts(self) -> tuple:
        """(``lengths_uniform``, checkpoint reached): what this plan's choice turned on in its host
        lengths, None where it did not."""
        return self.lengths_uniform, None if self.checkpoint_reach is None else self.checkpoint_reach[1]

    def _begin(self, stream, call: PrefillCall, host_cu):
        """One call's checks and allocations, before anything launches: (out, final_state, the
        int32 device cu_seqlens to keep alive until the launches are issued, the call's values by
        parameter name: what every launch of the plan takes per call, ``LoadedKernel.per_call``).
        ``host_cu``: the host cu_seqlens when the caller already read (and, if the signature
        checks them, checked) them."""
        c, device = self.c, self.device
        x, sink, out, final_state = call.inputs, call.checkpoints, call.out, call.final_state
        q, gate = x.q, x.gate
        lower_bound, scale = check_scalars(gate.lower_bound, x.scale)
        # Every address once: the per-call checks (alignment, aliasing) and the launches use them.
        qp, kp, vp, gp, bp, ap, dp = (
            q.data_ptr(),
            x.k.data_ptr(),
            x.v.data_ptr(),
            x.g.data_ptr(),
            x.beta.data_ptr(),
            gate.A_log.data_ptr(),
            gate.dt_bias.data_ptr(),
        )
        # Explicit rather than a loop: this is the eager call's hot path.
        ip = 0 if call.initial_state is None else call.initial_state.data_ptr()
        fp = 0 if final_state is None else final_state.data_ptr()
        op = 0 if out is None else out.data_ptr()
        xp = 0 if call.state_indices is None else call.state_indices.data_ptr()
        sp = 0 if call.status is None else call.status.data_ptr()
        cp = 0 if sink.pool is None else sink.pool.data_ptr()
        ci = 0 if sink.indices is None else sink.indices.data_ptr()
        co = 0 if sink.offsets is None else sink.offsets.data_ptr()
        if (
            (qp | kp | vp | gp | bp | ap | dp | ip | fp | op | xp | sp | cp | ci | co) & 15
            or op in (qp, kp, vp, gp)
            or fp in (qp, kp, vp, gp)
            or cp in (qp, kp, vp, gp)
        ):
            check_addresses(call)
        cu_seqlens = call.cu_seqlens
        if c.seqlens_checked and host_cu is None:
            host_cu_seqlens(cu_seqlens, call.cu_seqlens_cpu, c.seq_len)
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
            op = out.data_ptr()
        if self.alloc_final:
            final_state = torch.empty(c.num_seqs, c.heads, D, D, dtype=torch.float32, device=device)
            fp = final_state.data_ptr()
        workspaces = ARENA.pointers(device, self.slots, stream) if self.slots else ()
        cu32 = None
        if cu_seqlens is not None:
            cu32 = (
                cu_seqlens
                if cu_seqlens.dtype == torch.int32 and cu_seqlens.device == device
                else cu_seqlens.to(device=device, dtype=torch.int32)
            )
        values = {
            "q": qp,
            "k": kp,
            "g": gp,
            "beta": bp,
            "a_log": ap,
            "dt_bias": dp,
            "v": vp,
            "out": op,
            "initial_state": ip,
            "final_state": fp,
            "cu_seqlens": 0 if cu32 is None else cu32.data_ptr(),
            "state_indices": xp,
            "status": sp,
            "segments": 0,
            "scale": scale,
            "lower_bound": lower_bound,
            "checkpoints": cp,
            "checkpoint_indices": ci,
            "checkpoint_offsets": co,
        }
        values.update(zip(_WORKSPACES, workspaces))
        return out, final_state, cu32, values

    def run(self, call: PrefillCall, host_cu=None):
        """One call of a serial plan: its checks and allocations, then its ``launches`` in order
        (the CP plan has its own)."""
        stream = _raw_stream(self.device)
        out, final_state, _cu32, values = self._begin(stream, call, host_cu)
        for template in self.launches:
            template.launch(values, stream)
        return out, final_state


def _serial_chain_values(
    c: Checked, state_layout: str, init_flags: int, final_flags: int, status_flag: int, order: int
) -> dict:
    """The serial chain's static values (K2's, and the fused kernel's): v and out token strides,
    both states' slot counts, slot and element strides (an allocated final state: N packed
    slots), and the flags (``order``: the grid order bit, ``prefill.SERIAL_K2_ORDER``)."""
    stride_k, stride_v = (1, D) if state_layout == "vk" else (D, 1)
    return {
        "v_row_stride": c.strides["v"],
        "out_row_stride": c.strides.get("out", c.heads * D),
        "init_slots": c.init_slots,
        "final_slots": c.final_slots or c.num_seqs,
        "init_slot_stride": c.init_slot_stride,
        "final_slot_stride": c.final_slot_stride or c.heads * D * D,
        "init_stride_k": stride_k,
        "init_stride_v": stride_v,
        "final_stride_k": stride_k,
        "final_stride_v": stride_v,
        "flags": init_flags | final_flags | status_flag | order | c.checkpoints.flags,
        **_checkpoint_values(c.checkpoints, state_layout),
    }


class _SerialPlan(_Plan):
    """The serial path (K1, K2) for one call signature: launched from templates while the
    call's lengths keep it serial."""

    def __init__(self, call: PrefillCall, c: Checked, path: Path, k1, k2, device):
        super().__init__(call, c, path, k1, device)
        chain = _serial_chain_values(
            c, self.state_layout, self.init_flags, self.final_flags, self.status_flag, SERIAL_K2_ORDER
        )
        self.k2 = k2.template({**self.geometry, **chain}, dependent=DEPENDENT_LAUNCH)
        self.launches = (self.k1, self.k2)


class _FusedPlan(_Plan):
    """The serial path as one fused kernel (``kernels/fused_prefill.py``: K1's work and K2's
    chain in one CTA per (sequence, head), no workspaces) for one call signature."""

    def __init__(self, call: PrefillCall, c: Checked, path: Path, fused, device):
        super().__init__(call, c, path, None, device)
        chain = _serial_chain_values(
            c, self.state_layout, self.init_flags, self.final_flags, self.status_flag, SERIAL_K2_ORDER
        )
        if call.cu_seqlens is not None:  # one kernel for both inputs: the grid's rows are then cu_seqlens'
            chain["flags"] |= FLAG_VARLEN
        self.kernel = fused.template(
            {**self.geometry, **input_geometry(c.batch, c.seq_len, c.heads, c.strides), **chain}
        )
        self.launches = (self.kernel,)


class _CPPlan(_Plan):
    """The intracard-CP chain (K1, pre_scan, merge, segmented K2) for one call signature, one
    set of lengths and one s_split: its segment plan and the four launch templates, so a
    repeated call skips validation, planning, table building and descriptor encoding."""

    serial = False

    def __init__(self, call: PrefillCall, c: Checked, path: Path, loader, k1, device):
        super().__init__(call, c, path, k1, device)
        segments, self.s_split = path.segments, path.s_split
        sms, state_layout, alloc_final = prepare.sm_count(device), self.state_layout, self.alloc_final
        init_flags, final_flags, status_flag = self.init_flags, self.final_flags, self.status_flag
        heads = c.heads
        n_prescan = prescan_jobs(segments)
        n_segments = self.n_segments = sum(len(seq) for seq in segments)
        # Each CP launch's kernel by its own grid: the merge's column block, the segmented K2's
        # V block for the pre_scan rows and for the recurrence rows.  Resolved before the first
        # launch: a missing cubin fails before anything runs.
        merge = loader.get(device, MergeSpec(v_block=merge_v_block(heads, c.num_seqs, sms)))
        prescan_k2 = loader.get(device, segmented_k2_spec(segmented_v_block(heads, n_prescan, sms), prescan=True))
        recurrence_k2 = loader.get(
            device,
            segmented_k2_spec(segmented_v_block(heads, n_segments, sms), checkpointing=c.checkpoints.every > 0),
        )
        # One int32 buffer per plan: the pre_scan rows, the recurrence rows, the per-sequence
        # bounds (at a multiple of 32 bytes), then (varlen) the host cu_seqlens the plan was made
        # from (at a multiple of 16 bytes): K1 reads those, so the records always match the
        # table, whatever the device cu_seqlens holds.
        self.segments = segments
        self.host_cu = c.host_cu
        self.table_key = (
            device.index,
            c.batch,
            c.seq_len,
            None if c.host_cu is None else tuple(c.host_cu),
            self.s_split,
            init_flags,
            final_flags,
        )
        row_bytes = 4 * SEGMENT_FIELDS
        self.main_rows_at, self.bounds_at = row_bytes * n_prescan, row_bytes * (n_prescan + n_segments)
        self.cu_at = self.bounds_at + 16 * -(-4 * (len(segments) + 1) // 16)
        # [*, H, V, K] ("vk", the public default) or [*, H, K, V]: S[k, v] at k·sk + v·sv.  The
        # transition pairs (M_i, B_i) and carries are fp32 [K, V] row-major per head.
        stride_k, stride_v = (1, D) if state_layout == "vk" else (D, 1)
        packed_slot = heads * D * D
        # The rows' states: carries (init), transition pairs (the pre_scan's final), the user's final
        # state (the recurrence's); the user's pool slot counts bound the indexed ones.
        k2_common = {
            **self.geometry,
            "v_row_stride": c.strides["v"],
            "out_row_stride": c.strides.get("out", heads * D),
            "init_slots": n_segments,
            "init_slot_stride": packed_slot,
            "init_stride_k": D,
            "init_stride_v": 1,
        }
        # The pre_scan's states are segment maps, not the sequence's: no checkpoints.  Its first-
        # segment rows start from the user's initial state (its pool slot, dtype and layout).
        self.prescan = prescan_k2.template(
            {
                **k2_common,
                **_checkpoint_values(NO_CHECKPOINTS, state_layout),
                "num_seqs": n_prescan,
                "init_slots": c.init_slots,
                "init_slot_stride": c.init_slot_stride,
                "init_stride_k": stride_k,
                "init_stride_v": stride_v,
                "final_slots": 2 * n_segments,
                "final_slot_stride": packed_slot,
                "final_stride_k": D,
                "final_stride_v": 1,
                "flags": 0,
            },
            dependent=DEPENDENT_LAUNCH,
        )
        self.merge = merge.template(
            {
                "num_seqs": c.num_seqs,
                "heads": heads,
                "init_slots": c.init_slots,
                "init_slot_stride": c.init_slot_stride,
                "init_stride_k": stride_k,
                "init_stride_v": stride_v,
                "flags": init_flags | status_flag,
            },
            dependent=DEPENDENT_LAUNCH,
        )
        self.recurrence = recurrence_k2.template(
            {
                **k2_common,
                "num_seqs": n_segments,
                "final_slots": c.num_seqs if alloc_final else c.final_slots,
                "final_slot_stride": packed_slot if alloc_final else c.final_slot_stride,
                "final_stride_k": stride_k,
                "final_stride_v": stride_v,
                "flags": status_flag | c.checkpoints.flags,
                **_checkpoint_values(c.checkpoints, state_layout),
            },
            dependent=DEPENDENT_LAUNCH,
        )

    def _table_values(self) -> list[int]:
        prescan_rows, main_rows, bounds = _segment_tables(self.segments, self.init_flags, self.final_flags)
        values = [v for row in prescan_rows + main_rows for v in row] + bounds
        if self.host_cu is not None:
            values += [0] * (self.cu_at // 4 - len(values)) + list(self.host_cu)
        return values

    def run(self, call: PrefillCall, host_cu=None):
        c, device = self.c, self.device
        torch_stream = torch.cuda.current_stream(device)  # read once: every launch goes here
        stream = torch_stream.cuda_stream
        out, final_state, _cu32, values = self._begin(stream, call, host_cu)
        rows, k1_values = _tabled(self, values, torch_stream, "intracard CP", ", or pass intracard_cp=False")
        # Transition pairs (M_i, B_i) and merged start states.
        prescan = torch.empty(2 * self.n_segments, c.heads, D, D, dtype=torch.float32, device=device)
        carries = torch.empty(self.n_segments, c.heads, D, D, dtype=torch.float32, device=device)
        pp, cp = prescan.data_ptr(), carries.data_ptr()
        self.k1.launch(k1_values, stream)
        # The pre_scan writes transition pairs, not the user's states; the merge reports bad slots.
        self.prescan.launch({**values, "final_state": pp, "status": 0, "segments": rows}, stream)
        self.merge.launch({**values, "prescan": pp, "carries": cp, "seq_segments": rows + self.bounds_at}, stream)
        self.recurrence.launch({**values, "initial_state": cp, "segments": rows + self.main_rows_at}, stream)
        return out, final_state


def _tabled(plan, values: dict, torch_stream, what: str, alternative: str = "") -> tuple:
    """A CP or pieces plan's device table (the address of its rows) and K1's launch values, which
    place the records by the lengths the table was planned from.  Looked up before any launch, so
    nothing on the GPU waits for Python between them, and on every call, not held: the lookup
    records this call's stream and marks a table a capture uses, which is then never evicted."""
    table = SEGMENT_TABLES.get(plan.table_key, plan._table_values, plan.device, torch_stream)
    if table is None:
        fail(
            f"{what} under CUDA-graph capture needs its segment plan built eagerly first: run the same call "
            f"(same lengths) once before capturing{alternative}"
        )
    rows = table.data_ptr()
    return rows, values if plan.host_cu is None else {**values, "cu_seqlens": rows + plan.cu_at}


def _piece_rows(segments, init_flags: int, final_flags: int) -> list:
    """One segmented-K2 row per piece: every piece may start from its sequence's initial state
    (``init_flags``, read only where its walk does not certify), a sequence's last writes the
    final state (``final_flags``)."""
    rows = []
    for seq_pieces in segments:
        start = seq_pieces[0].first_token
        for n, seg in enumerate(seq_pieces):
            last = n + 1 == len(seq_pieces)
            rows.append(_segment_row(seg, start, seg.seq, seg.seq, init_flags | (final_flags if last else 0)))
    return rows


class _PieceTablePlan(_Plan):
    """What both certified-truncation plans share: one piece row per piece (``_rows``), tabled once
    per signature, lengths and split, the host cu_seqlens after the rows (at a multiple of 16
    bytes) for K1 where it runs."""

    serial = False
    kind = ""

    def __init__(self, call: PrefillCall, c: Checked, path: Path, k1, device):
        super().__init__(call, c, path, k1, device)
        self.segments, self.s_split, self.host_cu = path.segments, path.s_split, c.host_cu
        self.n_rows = sum(len(seq) for seq in self.segments)
        self.cu_at = 16 * -(-4 * SEGMENT_FIELDS * self.n_rows // 16)
        # The pieces themselves, not the split: the fused pieces' lengths turn on H as well.
        self.table_key = (
            self.kind,
            device.index,
            c.batch,
            c.seq_len,
            None if c.host_cu is None else tuple(c.host_cu),
            tuple(seg.num_tokens for seq in self.segments for seg in seq),
            self.init_flags,
            self.final_flags,
        )

    def _table_values(self) -> list[int]:
        values = [v for row in self._rows(self.segments, self.init_flags, self.final_flags) for v in row]
        if self.host_cu is not None:
            values += [0] * (self.cu_at // 4 - len(values)) + list(self.host_cu)
        return values


class _PiecesPlan(_PieceTablePlan):
    """Certified-truncation pieces (``intracard_cp="truncated"``) for one call signature, one set of
    lengths and one split: K1, the tile bounds (``kernels/tile_bound.py``, written after the H·total_slots
    records in the stream's arena), then the walk variant of the segmented K2 over one row per
    piece, which starts a piece from zero where the bounds before it certify and from its
    sequence's start elsewhere (docs/DESIGN.md, Certified truncation)."""

    kind = "pieces"
    _rows = staticmethod(_piece_rows)

    def __init__(self, call: PrefillCall, c: Checked, path: Path, loader, k1, device):
        super().__init__(call, c, path, k1, device)
        heads, total_slots, n_rows = c.heads, self.geometry["total_slots"], self.n_rows
        walk_k2 = loader.get(
            device, segmented_k2_spec(segmented_v_block(heads, n_rows, prepare.sm_count(device)), walk=True)
        )
        bound = loader.get(device, TileBoundSpec())
        self.bound = bound.template({"total_slots": total_slots, "heads": heads, **tile_bound_grid(total_slots)})
        stride_k, stride_v = (1, D) if self.state_layout == "vk" else (D, 1)
        self.recurrence = walk_k2.template(
            {
                **self.geometry,
                **_checkpoint_values(NO_CHECKPOINTS, self.state_layout),
                "num_seqs": n_rows,
                "v_row_stride": c.strides["v"],
                "out_row_stride": c.strides.get("out", heads * D),
                "init_slots": c.init_slots,
                "init_slot_stride": c.init_slot_stride,
                "init_stride_k": stride_k,
                "init_stride_v": stride_v,
                "final_slots": c.num_seqs if self.alloc_final else c.final_slots,
                "final_slot_stride": heads * D * D if self.alloc_final else c.final_slot_stride,
                "final_stride_k": stride_k,
                "final_stride_v": stride_v,
                "flags": self.status_flag,
            },
            dependent=DEPENDENT_LAUNCH,
        )

    def run(self, call: PrefillCall, host_cu=None):
        device = self.device
        torch_stream = torch.cuda.current_stream(device)
        stream = torch_stream.cuda_stream
        # The arena holds the records, then one fp32 bound per record (before it is carved).
        ARENA.buffer(device, self.slots * (WORKSPACE_RECORD_BYTES + 4), stream)
        out, final_state, _cu32, values = self._begin(stream, call, host_cu)
        rows, k1_values = _tabled(self, values, torch_stream, "intracard_cp='truncated'")
        self.k1.launch(k1_values, stream)
        self.bound.launch({**values, "bounds": values["workspace"] + self.slots * WORKSPACE_RECORD_BYTES}, stream)
        self.recurrence.launch({**values, "segments": rows}, stream)
        return out, final_state


def _fused_piece_rows(segments, init_flags: int, final_flags: int) -> list:
    """One fused-pieces row per piece, as ``_piece_rows`` but in ``cp_plan.piece_order`` (a
    predecessor's items take their tickets before its successor's; the pieces with a successor,
    ``FLAG_SUCCESSOR``, first), each naming its predecessor's row (``layout.SEG_PREDECESSOR``;
    -1: none)."""
    order = cp_plan.piece_order([len(seq_pieces) for seq_pieces in segments])
    row_of = {piece: r for r, piece in enumerate(order)}
    rows = []
    for s, n in order:
        seq_pieces = segments[s]
        seg, last = seq_pieces[n], n + 1 == len(seq_pieces)
        flags = init_flags | (final_flags if last else FLAG_SUCCESSOR)
        row = _segment_row(seg, seq_pieces[0].first_token, seg.seq, seg.seq, flags)
        row[SEG_PREDECESSOR] = row_of[(s, n - 1)] if n else -1
        rows.append(row)
    return rows


class _FusedPiecesPlan(_PieceTablePlan):
    """The fused kernel over certified pieces (``intracard_cp="truncated"``,
    ``kernels/fused_prefill.FusedPieces``) for one call signature, one set of lengths and one
    split: one launch over a piece table, after zeroing the ticket counters and the ready flags.
    Those and the published end states (fp32, 64 KB per item of a piece with a successor) live in
    the stream's arena."""

    kind = "fused_pieces"
    _rows = staticmethod(_fused_piece_rows)

    def __init__(self, call: PrefillCall, c: Checked, path: Path, kernel, device):
        super().__init__(call, c, path, None, device)
        # A ticket counter per head, then the ready flags of the items of the rows with a
        # successor (the first rows).
        self.publishing = sum(len(seq) - 1 for seq in self.segments) * c.heads
        self.control_words = c.heads + self.publishing
        self.ready_bytes = 256 * -(-4 * self.control_words // 256)
        chain = _serial_chain_values(c, self.state_layout, self.init_flags, self.final_flags, self.status_flag, 0)
        chain["flags"] = self.status_flag  # the rows carry the state flags
        self.kernel = kernel.template(
            {
                **self.geometry,
                **input_geometry(c.batch, c.seq_len, c.heads, c.strides),
                **chain,
                "num_rows": self.n_rows,
            }
        )

    def run(self, call: PrefillCall, host_cu=None):
        device = self.device
        torch_stream = torch.cuda.current_stream(device)
        stream = torch_stream.cuda_stream
        exchange = ARENA.buffer(device, self.ready_bytes + self.publishing * D * D * 4, stream).data_ptr()
        out, final_state, _cu32, values = self._begin(stream, call, host_cu)
        rows, values = _tabled(self, values, torch_stream, "intracard_cp='truncated'")
        _zero_words(exchange, self.control_words, stream)
        self.kernel.launch(
            {**values, "segments": rows, "ready": exchange, "carries": exchange + self.ready_bytes}, stream
        )
        return out, final_state
