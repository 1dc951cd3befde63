"""The KDA prefill: validation, K1 then K2 (or the CP chain) on the current stream (docs/CONTRACT.md §5, §6, §9).

Validation runs entirely before the first launch, so a rejected call writes nothing.  The serial
path never reads a device tensor on the host: grids come from shapes (``layout.varlen_total_slots``)
and cu_seqlens values are checked on the host only when that is free (``cu_seqlens_cpu``, or a CPU
cu_seqlens) or asked for (``check_seqlens="host"``, a sync).  Inputs may be token-strided views;
states may be fp32 or bf16, plain or pools indexed by ``state_indices``.
"""

import dataclasses
import functools

import torch

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
    SEG_FINAL_INDEX,
    SEG_FIRST_SLOT,
    SEG_FIRST_TOKEN,
    SEG_FLAGS,
    SEG_INIT_INDEX,
    SEG_SEQ,
    SEG_TOKENS,
    SEGMENT_FIELDS,
    D,
)
from ..runtime.loader import default_loader
from ..specs import (WORKSPACE_POINTERS, K2_SEGMENTED_V_BLOCK, K1Spec, MergeSpec, auto_fused, auto_v_block, fused_spec,
                     k1_grid, merge_v_block, segmented_k2_spec, segmented_v_block, serial_k2_spec)
from . import cp_plan
from .checks import KDAInputError, check_dtype_shape, check_scalars, check_status, fail  # noqa: F401 (re-exported)
from .prepare import input_geometry, plan_slots
from .prepare import sm_count as _sm_count
from .workspace import ARENA, SEGMENT_TABLES

STATE_LAYOUTS = ("vk", "kv")
STATE_DTYPES = (torch.float32, torch.bfloat16)
SEQLEN_CHECKS = ("auto", "host", "off")


def _check_tensor(name, t, dtype, shape, device):
    check_dtype_shape(name, t, dtype, shape, device)
    if not t.is_contiguous():
        fail(f"{name} must be contiguous; call {name}.contiguous()")


def _check_token_tensor(name, t, dtype, shape, device, packed: tuple, aligned_rows: bool = True) -> int:
    """Check a token-major input/output ``[B, T, *packed dims]`` that may be a token-strided view
    (e.g. a slice of one fused projection): the trailing dims must be packed, rows 16-byte
    aligned, and batches ``T`` rows apart.  Returns the token stride in elements."""
    check_dtype_shape(name, t, dtype, shape, device)
    strides, inner = t.stride(), 1
    for dim in range(t.dim() - 1, 1, -1):  # the packed dims, innermost first (size-1 dims: any stride)
        if shape[dim] > 1 and strides[dim] != inner:
            fail(f"{name} must have its last {t.dim() - 2} dims packed (strides ..., {', '.join(map(str, packed))}); "
                  f"got strides {list(strides)}: only the token dim may be strided; call {name}.contiguous()")
        inner *= shape[dim]
    batch, seq_len = shape[0], shape[1]
    row = strides[1] if seq_len > 1 else (strides[0] if batch > 1 else inner)
    if row < inner:
        fail(f"{name}'s token stride {row} is smaller than a token's {inner} elements (overlapping rows); "
              f"call {name}.contiguous()")
    if batch > 1 and seq_len > 1 and strides[0] != seq_len * row:
        fail(f"{name}'s batch stride {strides[0]} must be T x token stride = {seq_len * row}; "
              f"call {name}.contiguous() or flatten to varlen [1, B*T, ...] with cu_seqlens")
    if aligned_rows and row * t.element_size() % 16:
        fail(f"{name} must have 16-byte aligned rows (token stride {row} elements); call {name}.contiguous()")
    return row


def _check_state(name, t, leading: int, leading_what: str, heads: int, device) -> int:
    """A state tensor ``[leading, H, 128, 128]`` in fp32 or bf16 whose slots may be padded apart
    (a state pool); returns its slot stride in elements."""
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in STATE_DTYPES:
        fail(f"{name} must be torch.float32 or torch.bfloat16, got {t.dtype}; convert it with {name}.float()")
    if t.dim() != 4 or tuple(t.shape[1:]) != (heads, D, D) or (leading >= 0 and t.shape[0] != leading):
        want = [leading if leading >= 0 else leading_what, heads, D, D]
        fail(f"{name} must have shape {want} ({leading_what}), got {list(t.shape)}")
    if t.device != device:
        fail(f"{name} is on {t.device} but q is on {device}; move all inputs to one CUDA device")
    slot = D * D * heads
    strides = t.stride()
    if strides[2:] != (D, 1) or (heads > 1 and strides[1] != D * D):
        fail(f"{name} must be packed within each state (strides [*, {D * D}, {D}, 1]), got strides "
              f"{list(strides)}; call {name}.contiguous()")
    stride = strides[0] if t.shape[0] > 1 else slot
    if stride < slot:
        fail(f"{name}'s slot stride {stride} is smaller than one slot's {slot} elements (overlapping states)")
    if stride * t.element_size() % 16:
        fail(f"{name} must have 16-byte aligned slots (slot stride {stride})")
    if stride >= 2**31:
        fail(f"{name}'s slot stride {stride} does not fit in int32")
    return stride


def _check_device(device) -> None:
    if device.type != "cuda":
        fail(f"inputs are on {device}: cula_aot runs on CUDA (sm_90a) devices only; move them with .cuda()")


def _check_addresses(q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, out, state_indices,
                     status=None) -> None:
    """Per-call rules on addresses: 16-byte aligned bases (the kernels' pointer and TMA
    assumption) and outputs that do not alias an input."""
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
             "initial_state": initial_state, "final_state": final_state, "out": out, "state_indices": state_indices,
             "status": status}
    for name, t in named.items():
        if t is not None and t.data_ptr() % 16:
            fail(f"{name} must start on a 16-byte boundary (its storage offset breaks it); call {name}.clone()")
    inputs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr())
    for name, t in (("out", out), ("final_state", final_state)):
        if t is not None and t.data_ptr() in inputs:
            fail(f"{name} must not alias an input tensor")


def _read_host_cu(cu_seqlens, cu_seqlens_cpu, checked: bool, total_tokens: int) -> list[int] | None:
    """The host cu_seqlens values: checked (``_host_cu_seqlens``) when ``checked``, else read
    unchecked from ``cu_seqlens_cpu`` when given (free to read; CP planning uses it), else None."""
    if checked:
        return _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, total_tokens)
    return None if cu_seqlens_cpu is None else [int(x) for x in cu_seqlens_cpu.tolist()]


def _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, total_tokens: int) -> list[int]:
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    # Here for validate and for the cached plans' per-call checks alike.
    if source.is_cuda and torch.cuda.is_current_stream_capturing():
        fail("check_seqlens='host' copies a device cu_seqlens to the host, which CUDA-graph capture forbids; "
              "pass cu_seqlens_cpu, or check_seqlens='off'")
    values = [int(x) for x in source.tolist()]
    if cu_seqlens_cpu is not None and cu_seqlens.numel() != len(values):
        fail(f"cu_seqlens_cpu has {len(values)} entries but cu_seqlens has {cu_seqlens.numel()}")
    if values[0] != 0:
        fail(f"cu_seqlens must start at 0, got {values[0]}")
    for n, (a, b) in enumerate(zip(values, values[1:])):
        if b < a:
            fail(f"cu_seqlens must be non-decreasing: cu_seqlens[{n + 1}] = {b} < cu_seqlens[{n}] = {a}")
        if b == a:
            fail(f"cu_seqlens describes an empty sequence {n} ({a}..{b}); drop empty sequences")
    if values[-1] != total_tokens:
        fail(f"cu_seqlens must end at T = {total_tokens} (q.shape[1]), got {values[-1]}")
    return values


@dataclasses.dataclass
class Checked:
    """What ``validate`` derived from the arguments: geometry, strides and the state plan."""

    batch: int
    seq_len: int
    heads: int
    num_seqs: int
    scale: float
    host_cu: list | None  # host copy of cu_seqlens values when available without a sync
    seqlens_checked: bool  # host_cu's values were checked (and must be again on every call)
    strides: dict  # token strides (elements) of q, k, v, g, beta and out (when given)
    init_slot_stride: int
    final_slot_stride: int
    init_slots: int  # leading size of initial_state (pool slots), 0 without one
    final_slots: int


def _check_seqlens_choice(check_seqlens, cu_seqlens, cu_seqlens_cpu) -> bool:
    """Whether to check cu_seqlens values on the host (see ``prefill``)."""
    if check_seqlens == "off":
        return False
    if check_seqlens == "host":
        return True  # a device cu_seqlens is read (a sync) by _host_cu_seqlens, which refuses it under capture
    return cu_seqlens_cpu is not None or not cu_seqlens.is_cuda  # "auto": only when it costs no sync


def validate(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale, initial_state, cu_seqlens,
             cu_seqlens_cpu, state_layout, out, final_state, intracard_cp="auto", state_indices=None,
             check_seqlens="auto", status=None) -> Checked:
    """Check every argument before anything launches (the device rule last, so every other rule
    is testable on the CPU)."""
    if not isinstance(q, torch.Tensor):
        fail(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        fail(f"q must be [B, T, H, {D}], got shape {list(q.shape)}")
    batch, seq_len, heads, dim = q.shape
    if dim != D:
        fail(f"head dim must be {D} (cula_aot builds D = K = V = {D} only), got q.shape[-1] = {dim}")
    if seq_len == 0 or batch == 0 or heads == 0:
        fail(f"q must have B, T, H > 0, got shape {list(q.shape)}")
    device = q.device
    token_shape = (batch, seq_len, heads, D)
    strides = {name: _check_token_tensor(name, t, torch.bfloat16, token_shape, device, (D, 1))
               for name, t in (("q", q), ("k", k), ("v", v), ("g", g))}
    beta_stride = _check_token_tensor("beta", beta, torch.bfloat16, (batch, seq_len, heads), device, (1,),
                                      aligned_rows=False)
    _check_tensor("A_log", A_log, torch.float32, (heads,), device)
    _check_tensor("dt_bias", dt_bias, torch.float32, (heads, D), device)
    lower_bound, scale = check_scalars(lower_bound, scale)
    if state_layout not in STATE_LAYOUTS:
        fail(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if check_seqlens not in SEQLEN_CHECKS:
        fail(f"check_seqlens must be one of {SEQLEN_CHECKS}, got {check_seqlens!r}")

    # Identity tests: 0 == False and 1 == True, but 0 is no s_split.
    if not (intracard_cp is True or intracard_cp is False or (isinstance(intracard_cp, str) and intracard_cp == "auto")
            or (type(intracard_cp) is int and intracard_cp >= 1)):
        fail(f"intracard_cp must be 'auto', True, False or an int s_split >= 1, got {intracard_cp!r}")

    num_seqs = batch
    host_cu = None
    seqlens_checked = False
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            fail("cu_seqlens must be an int32 or int64 tensor")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            fail(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {list(cu_seqlens.shape)}")
        if cu_seqlens.device not in (device, torch.device("cpu")):
            fail(f"cu_seqlens is on {cu_seqlens.device}; put it on {device} (or the CPU)")
        if batch != 1:
            fail(f"varlen input (cu_seqlens) needs batch size 1, got B = {batch}; flatten to [1, total, H, {D}]")
        num_seqs = cu_seqlens.numel() - 1
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.numel() != cu_seqlens.numel():
            fail(f"cu_seqlens_cpu has {cu_seqlens_cpu.numel()} entries but cu_seqlens has {cu_seqlens.numel()}")
        seqlens_checked = _check_seqlens_choice(check_seqlens, cu_seqlens, cu_seqlens_cpu)
        host_cu = _read_host_cu(cu_seqlens, cu_seqlens_cpu, seqlens_checked, seq_len)
    elif cu_seqlens_cpu is not None:
        fail("cu_seqlens_cpu was given without cu_seqlens")

    # States: plain [N, H, 128, 128], or pools [slots, H, 128, 128] addressed by state_indices.
    if state_indices is not None:
        _check_tensor("state_indices", state_indices, torch.int32, (num_seqs,), device)
        if initial_state is None and final_state is None:
            fail("state_indices selects slots of a state pool: pass the pool as initial_state and/or final_state")
    leading, leading_what = (-1, "pool slots") if state_indices is not None else (num_seqs, "N sequences")
    init_slot = final_slot = 0
    if initial_state is not None:
        init_slot = _check_state("initial_state", initial_state, leading, leading_what, heads, device)
    if final_state is not None:
        final_slot = _check_state("final_state", final_state, leading, leading_what, heads, device)
    if out is not None:
        out_stride = _check_token_tensor("out", out, torch.bfloat16, token_shape, device, (D, 1))
    check_status(status, device)
    _check_addresses(q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, out, state_indices, status)
    # Last, so every shape/dtype/value rule above is also checked (and testable) on the CPU.
    _check_device(device)
    strides["beta"] = beta_stride
    if out is not None:
        strides["out"] = out_stride
    init_slots, final_slots = (0 if t is None else t.shape[0] for t in (initial_state, final_state))
    return Checked(batch, seq_len, heads, num_seqs, scale, host_cu, seqlens_checked, strides, init_slot, final_slot,
                   init_slots, final_slots)


def _resolve_split(intracard_cp, batch, seq_len, heads, cu_seqlens, host_cu, device) -> int:
    if intracard_cp is False:
        return 1
    if cu_seqlens is not None and host_cu is None:
        # Lengths live on the device only: planning would need a sync.
        if intracard_cp == "auto":
            return 1
        fail("intracard_cp needs the sequence lengths on the host: pass cu_seqlens_cpu "
              "(or check_seqlens='host', which copies cu_seqlens and synchronises)")
    if type(intracard_cp) is int:
        return intracard_cp
    lengths = [seq_len] * batch if host_cu is None else [b - a for a, b in zip(host_cu, host_cu[1:])]
    s_split = planned_split(lengths, heads, device)
    return max(s_split, 2) if intracard_cp is True else s_split


def planned_split(lengths, heads: int, device) -> int:
    """The s_split ``intracard_cp="auto"`` takes for these host sequence lengths on ``device``
    (1 = serial)."""
    return _cached_split(tuple(lengths), heads, _sm_count(device))


@functools.lru_cache(maxsize=256)
def _cached_split(lengths: tuple, heads: int, sm_count: int) -> int:
    # Eager "auto" calls re-plan from their lengths every time; a serving loop repeats a few
    # length sets, and the full search costs ~50 µs for one long sequence.  256 sets bound the
    # memory (a key holds every length of its batch).
    return cp_plan.auto_split(lengths, heads, sm_count, D // K2_SEGMENTED_V_BLOCK)


def _segment_row(seg, init_index, final_index, flags) -> list[int]:
    row = [0] * SEGMENT_FIELDS
    row[SEG_SEQ], row[SEG_FIRST_TOKEN], row[SEG_FIRST_SLOT] = seg.seq, seg.first_token, seg.first_slot
    row[SEG_TOKENS], row[SEG_INIT_INDEX], row[SEG_FINAL_INDEX], row[SEG_FLAGS] = (
        seg.num_tokens, init_index, final_index, flags)
    return row


def _segment_tables(segments, final_flags: int):
    """Rows of the pre_scan jobs and of the segmented recurrence, and each sequence's segment
    range.  Pre_scan job 2i (2i + 1) writes M_i (B_i) of segment i; segment i of the recurrence
    starts from carries[i]; a sequence's last segment writes the user's final state with
    ``final_flags`` (0: no final state)."""
    transition = FLAG_IDENTITY_INIT | FLAG_ZERO_V | FLAG_NO_OUTPUT | FLAG_FINAL_STATE
    prescan_rows, main_rows, bounds = [], [], [0]
    for seq_segments in segments:
        for n, seg in enumerate(seq_segments):
            index = len(main_rows)
            last = n + 1 == len(seq_segments)
            if not last:
                prescan_rows.append(_segment_row(seg, -1, 2 * index, transition))
                prescan_rows.append(_segment_row(seg, -1, 2 * index + 1, FLAG_NO_OUTPUT | FLAG_FINAL_STATE))
            main_rows.append(_segment_row(seg, index, seg.seq, FLAG_INITIAL_STATE | (final_flags if last else 0)))
        bounds.append(len(main_rows))
    return prescan_rows, main_rows, bounds


def _state_flags(state, which: str, indexed: bool) -> int:
    """K2 / merge flag bits for a user state tensor (``which`` = "init" or "final")."""
    if state is None:
        return 0
    present, pooled, bf16 = {"init": (FLAG_INITIAL_STATE, FLAG_INDEXED_INIT, FLAG_BF16_INIT),
                             "final": (FLAG_FINAL_STATE, FLAG_INDEXED_FINAL, FLAG_BF16_FINAL)}[which]
    return present | (pooled if indexed else 0) | (bf16 if state.dtype == torch.bfloat16 else 0)


def _raw_stream(device) -> int:
    """The current stream of ``device`` as a raw ``cudaStream_t`` (without building a Stream)."""
    return _current_raw_stream(device.index)


_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                              lambda index: torch.cuda.current_stream(index).cuda_stream)

# K1's and K2's per-call parameters (everything else is fixed by a _SerialPlan's signature).
_WORKSPACES = tuple(p.name for p in WORKSPACE_POINTERS)
_K1_DYNAMIC = ("q", "k", "g", "beta", "a_log", "dt_bias", "cu_seqlens", *_WORKSPACES, "scale", "lower_bound")
# Every launch after K1 is a programmatic dependent of the one before it (K1 → K2, or K1 →
# pre_scan → merge → segmented K2): its CTAs start while the previous grid drains and wait for
# its end before reading its output (``griddepcontrol``; see ``LoadedKernel.launch_packed``).
DEPENDENT_LAUNCH = True
_K2_DYNAMIC = ("v", "out", "initial_state", "final_state", "cu_seqlens", "state_indices", "status", *_WORKSPACES)


_FUSED_DYNAMIC = ("q", "k", "g", "beta", "a_log", "dt_bias", "v", "out", "initial_state", "final_state", "cu_seqlens",
                  "state_indices", "status", "scale", "lower_bound")

# The segmented K2's per-call parameters (pre_scan and recurrence rows alike) and the merge's.
_SEGMENTED_DYNAMIC = (*_K2_DYNAMIC, "segments")
_MERGE_DYNAMIC = ("initial_state", "prescan", "carries", "seq_segments", "state_indices", "status")
_K1_CU_SEQLENS = _K1_DYNAMIC.index("cu_seqlens")


class _Plan:
    """What the serial and the CP plan of one call signature (shapes, strides, dtypes, devices
    and options) share: the validated facts, K1's launch template, how a call's lengths pick its
    plan, and the per-call checks and allocations the signature does not fix (addresses,
    scalars, host cu_seqlens values)."""

    def __init__(self, c: Checked, k1, *, cu_seqlens, alloc_final, device, intracard_cp, split):
        self.c, self.device, self.alloc_final = c, device, alloc_final
        # A call's s_split: ``split`` when the signature fixes it; None: planned per call from the
        # call's host lengths (intracard_cp "auto" or True with host cu_seqlens: the signature
        # does not fix them).
        self.intracard_cp, self.split = intracard_cp, split
        total_slots = plan_slots(c.batch, c.seq_len, cu_seqlens)
        # The fused path (k1 None) has no workspaces.
        self.slots = 0 if k1 is None else c.heads * total_slots
        self.geometry = {"seq_len": c.seq_len, "num_seqs": c.num_seqs, "total_slots": total_slots, "heads": c.heads}
        if k1 is not None:
            self.k1 = k1.template({**self.geometry, **input_geometry(c.batch, c.seq_len, c.heads, c.strides),
                                   **k1_grid(total_slots, c.heads, _sm_count(device))}, _K1_DYNAMIC)

    def plan_for(self, key, cu_seqlens, cu_seqlens_cpu):
        """(the cached plan for this call's lengths, None when there is none yet; the host
        cu_seqlens read to choose it: checked when the signature checks them)."""
        if self.split == 1:
            return self, None
        c = self.c
        host_cu = None
        if self.split is None:
            host_cu = _read_host_cu(cu_seqlens, cu_seqlens_cpu, c.seqlens_checked, c.seq_len)
            s_split = _resolve_split(self.intracard_cp, c.batch, c.seq_len, c.heads, cu_seqlens, host_cu, self.device)
        else:
            s_split = self.split
        if s_split == 1:
            return (self if self.serial else None), host_cu
        return _PLANS.get(_cp_key(key, host_cu, s_split)), host_cu

    def _begin(self, stream, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
               cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu):
        """One call's checks and allocations, before anything launches: (out, final_state, the
        int32 device cu_seqlens to keep alive until the launches are issued, K1's dynamic values,
        the K2 values of ``_K2_DYNAMIC``).  ``host_cu``: the host cu_seqlens when the caller already
        read (and, if the signature checks them, checked) them."""
        c, device = self.c, self.device
        lower_bound, scale = check_scalars(lower_bound, scale)
        # Every address once: the per-call checks (alignment, aliasing) and the launches use them.
        qp, kp, vp, gp, bp, ap, dp = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                      A_log.data_ptr(), dt_bias.data_ptr())
        ip = 0 if initial_state is None else initial_state.data_ptr()
        fp = 0 if final_state is None else final_state.data_ptr()
        op = 0 if out is None else out.data_ptr()
        xp = 0 if state_indices is None else state_indices.data_ptr()
        sp = 0 if status is None else status.data_ptr()
        if (qp | kp | vp | gp | bp | ap | dp | ip | fp | op | xp | sp) & 15 or op in (qp, kp, vp, gp) \
                or fp in (qp, kp, vp, gp):
            _check_addresses(q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, out, state_indices, status)
        if c.seqlens_checked and host_cu is None:
            _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, c.seq_len)
        if out is None:
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
            op = out.data_ptr()
        if self.alloc_final:
            final_state = torch.empty(c.num_seqs, c.heads, D, D, dtype=torch.float32, device=device)
            fp = final_state.data_ptr()
        workspaces = ARENA.pointers(device, self.slots, stream) if self.slots else ()
        cu32 = None
        if cu_seqlens is not None:
            cu32 = cu_seqlens if cu_seqlens.dtype == torch.int32 and cu_seqlens.device == device else \
                cu_seqlens.to(device=device, dtype=torch.int32)
        cu_ptr = 0 if cu32 is None else cu32.data_ptr()
        return (out, final_state, cu32, (qp, kp, gp, bp, ap, dp, cu_ptr, *workspaces, scale, lower_bound),
                (vp, op, ip, fp, cu_ptr, xp, sp, *workspaces))


# The serial K2's grid order: varlen sequences longest first, so the longest chains start in the
# first wave (a fixed-length kernel ignores the bit; PERFORMANCE.md, K2 recurrence).
SERIAL_K2_ORDER = FLAG_LONGEST_FIRST


def _serial_chain_values(c: Checked, state_layout: str, init_flags: int, final_flags: int, status_flag: int) -> dict:
    """The serial chain's static values (K2's, and the fused kernel's): v and out token strides,
    both states' slot counts, slot and element strides (an allocated final state: N packed
    slots), and the flags."""
    stride_k, stride_v = (1, D) if state_layout == "vk" else (D, 1)
    return {"v_row_stride": c.strides["v"], "out_row_stride": c.strides.get("out", c.heads * D),
            "init_slots": c.init_slots, "final_slots": c.final_slots or c.num_seqs,
            "init_slot_stride": c.init_slot_stride, "final_slot_stride": c.final_slot_stride or c.heads * D * D,
            "init_stride_k": stride_k, "init_stride_v": stride_v, "final_stride_k": stride_k, "final_stride_v": stride_v,
            "flags": init_flags | final_flags | status_flag | SERIAL_K2_ORDER}


class _SerialPlan(_Plan):
    """The serial path (K1, K2) for one call signature: launched from templates while the
    call's lengths keep it serial."""

    serial = True

    def __init__(self, c: Checked, k1, k2, *, cu_seqlens, alloc_final, state_layout, init_flags, final_flags, status_flag,
                 device, intracard_cp, split):
        super().__init__(c, k1, cu_seqlens=cu_seqlens, alloc_final=alloc_final, device=device,
                         intracard_cp=intracard_cp, split=split)
        chain = _serial_chain_values(c, state_layout, init_flags, final_flags, status_flag)
        self.k2 = k2.template({**self.geometry, "segments": 0, **chain},
                              _K2_DYNAMIC, dependent=DEPENDENT_LAUNCH)

    def run(self, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
            cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu=None):
        stream = _raw_stream(self.device)
        out, final_state, _cu32, k1_values, k2_values = self._begin(
            stream, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
            cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu)
        self.k1.launch(k1_values, stream)
        self.k2.launch(k2_values, stream)
        return out, final_state


class _FusedPlan(_Plan):
    """The serial path as one fused kernel (``kernels/fused_prefill.py``: K1's work and K2's
    chain in one CTA per (sequence, head), no workspaces) for one call signature."""

    serial = True

    def __init__(self, c: Checked, fused, *, cu_seqlens, alloc_final, state_layout, init_flags, final_flags, status_flag,
                 device, intracard_cp, split):
        super().__init__(c, None, cu_seqlens=cu_seqlens, alloc_final=alloc_final, device=device,
                         intracard_cp=intracard_cp, split=split)
        chain = _serial_chain_values(c, state_layout, init_flags, final_flags, status_flag)
        if cu_seqlens is not None:  # one kernel for both inputs: the grid's rows are then cu_seqlens'
            chain["flags"] |= FLAG_VARLEN
        self.kernel = fused.template({
            **self.geometry, **input_geometry(c.batch, c.seq_len, c.heads, c.strides), **chain}, _FUSED_DYNAMIC)

    def run(self, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
            cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu=None):
        stream = _raw_stream(self.device)
        out, final_state, _cu32, (qp, kp, gp, bp, ap, dp, cu_ptr, scale, lower_bound), (vp, op, ip, fp, _, xp, sp) = \
            self._begin(stream, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
                        cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu)
        self.kernel.launch((qp, kp, gp, bp, ap, dp, vp, op, ip, fp, cu_ptr, xp, sp, scale, lower_bound), stream)
        return out, final_state


class _CPPlan(_Plan):
    """The intracard-CP chain (K1, pre_scan, merge, segmented K2) for one call signature, one
    set of lengths and one s_split: its segment plan and the four launch templates, so a
    repeated call skips validation, planning, table building and descriptor encoding."""

    serial = False

    def __init__(self, c: Checked, loader, k1, segments, s_split, *, cu_seqlens, alloc_final, state_layout, init_flags,
                 final_flags, status_flag, device, intracard_cp, split):
        super().__init__(c, k1, cu_seqlens=cu_seqlens, alloc_final=alloc_final, device=device,
                         intracard_cp=intracard_cp, split=split)
        heads, sm_count = c.heads, _sm_count(device)
        n_prescan = sum(2 * (len(seq) - 1) for seq in segments)
        n_segments = self.n_segments = sum(len(seq) for seq in segments)
        # Each CP launch's kernel by its own grid: the merge's column block, the segmented K2's
        # V block for the pre_scan rows and for the recurrence rows.  Resolved before the first
        # launch: an unbuilt head count fails before anything runs.
        merge = loader.get(device, MergeSpec(heads=heads, v_block=merge_v_block(heads, c.num_seqs, sm_count)))
        prescan_k2 = loader.get(device, segmented_k2_spec(heads, segmented_v_block(heads, n_prescan, sm_count),
                                                          prescan=True))
        recurrence_k2 = loader.get(device, segmented_k2_spec(heads, segmented_v_block(heads, n_segments, sm_count)))
        # One int32 buffer per plan: the pre_scan rows, the recurrence rows, the per-sequence
        # bounds (at a multiple of 32 bytes), then (varlen) the host cu_seqlens the plan was made
        # from (at a multiple of 16 bytes): K1 reads those, so the records always match the
        # table, whatever the device cu_seqlens holds.
        self.segments, self.final_flags = segments, final_flags
        self.host_cu = c.host_cu
        self.table_key = (device.index, c.batch, c.seq_len, None if c.host_cu is None else tuple(c.host_cu), s_split,
                          final_flags)
        row_bytes = 4 * SEGMENT_FIELDS
        self.main_rows_at, self.bounds_at = row_bytes * n_prescan, row_bytes * (n_prescan + n_segments)
        self.cu_at = self.bounds_at + 16 * -(-4 * (len(segments) + 1) // 16)
        # [*, H, V, K] ("vk", the public default) or [*, H, K, V]: S[k, v] at k·sk + v·sv.  The
        # transition pairs (M_i, B_i) and carries are fp32 [K, V] row-major per head.
        stride_k, stride_v = (1, D) if state_layout == "vk" else (D, 1)
        packed_slot = heads * D * D
        # The rows' states: carries (init), transition pairs (the pre_scan's final), the user's final
        # state (the recurrence's); the user's pool slot counts bound the indexed ones.
        k2_common = {**self.geometry, "v_row_stride": c.strides["v"], "out_row_stride": c.strides.get("out", heads * D),
                     "init_slots": n_segments, "init_slot_stride": packed_slot, "init_stride_k": D, "init_stride_v": 1}
        self.prescan = prescan_k2.template({
            **k2_common, "num_seqs": n_prescan, "final_slots": 2 * n_segments, "final_slot_stride": packed_slot,
            "final_stride_k": D, "final_stride_v": 1, "flags": 0}, _SEGMENTED_DYNAMIC, dependent=DEPENDENT_LAUNCH)
        self.merge = merge.template({
            "num_seqs": c.num_seqs, "heads": heads, "init_slots": c.init_slots, "init_slot_stride": c.init_slot_stride,
            "init_stride_k": stride_k, "init_stride_v": stride_v, "flags": init_flags | status_flag},
            _MERGE_DYNAMIC, dependent=DEPENDENT_LAUNCH)
        self.recurrence = recurrence_k2.template({
            **k2_common, "num_seqs": n_segments, "final_slots": c.num_seqs if alloc_final else c.final_slots,
            "final_slot_stride": packed_slot if alloc_final else c.final_slot_stride,
            "final_stride_k": stride_k, "final_stride_v": stride_v, "flags": status_flag},
            _SEGMENTED_DYNAMIC, dependent=DEPENDENT_LAUNCH)

    def _table_values(self) -> list[int]:
        prescan_rows, main_rows, bounds = _segment_tables(self.segments, self.final_flags)
        values = [v for row in prescan_rows + main_rows for v in row] + bounds
        if self.host_cu is not None:
            values += [0] * (self.cu_at // 4 - len(values)) + list(self.host_cu)
        return values

    def run(self, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
            cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu=None):
        c, device = self.c, self.device
        torch_stream = torch.cuda.current_stream(device)  # read once: every launch goes here
        stream = torch_stream.cuda_stream
        out, final_state, _cu32, k1_values, (vp, op, ip, fp, cu_ptr, xp, sp, *workspaces) = self._begin(
            stream, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
            cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu)
        # The tables before any launch, so nothing on the GPU waits for Python between them.
        # Looked up on every call, not held: the lookup records this call's stream and marks a
        # table a capture uses, which is then never evicted.
        table = SEGMENT_TABLES.get(self.table_key, self._table_values, device, torch_stream)
        if table is None:
            fail("intracard CP under CUDA-graph capture needs its segment plan built eagerly first: run the same "
                  "call (same lengths) once before capturing, or pass intracard_cp=False")
        rows = table.data_ptr()
        if self.host_cu is not None:  # K1 places the records by the lengths the table was planned from
            k1_values = (*k1_values[:_K1_CU_SEQLENS], rows + self.cu_at, *k1_values[_K1_CU_SEQLENS + 1:])
        # Transition pairs (M_i, B_i) and merged start states.
        prescan = torch.empty(2 * self.n_segments, c.heads, D, D, dtype=torch.float32, device=device)
        carries = torch.empty(self.n_segments, c.heads, D, D, dtype=torch.float32, device=device)
        pp, cp = prescan.data_ptr(), carries.data_ptr()
        self.k1.launch(k1_values, stream)
        # The pre_scan starts from 0 or the identity and writes transition pairs: no pool, no status.
        self.prescan.launch((vp, op, 0, pp, cu_ptr, xp, 0, *workspaces, rows), stream)
        self.merge.launch((ip, pp, cp, rows + self.bounds_at, xp, sp), stream)
        self.recurrence.launch((vp, op, cp, fp, cu_ptr, xp, sp, *workspaces, rows + self.main_rows_at), stream)
        return out, final_state


_PLANS: dict = {}  # signature → its serial or first CP plan; (signature, lengths, s_split) → CP plan
_PLAN_LIMIT = 256  # plans cached; cleared when full (a serving loop reuses a few)


def _signature(*tensors) -> tuple:
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _cp_key(key, host_cu, s_split) -> tuple:
    """A CP plan's cache key: the call signature, the host cu_seqlens (None: fixed length) and the split."""
    return key, None if host_cu is None else tuple(host_cu), s_split


def _remember(key, plan) -> None:
    if len(_PLANS) >= _PLAN_LIMIT:
        _PLANS.clear()
    _PLANS[key] = plan


def prefill(q, k, v, g, beta, *, A_log, dt_bias, lower_bound, scale=None, initial_state=None,
            output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None, state_layout="vk",
            out=None, final_state=None, intracard_cp="auto", state_indices=None, check_seqlens="auto",
            v_block=None, fused=None, status=None):
    """K1 then K2 (serial), or K1, pre_scan, merge and segmented K2 (intracard CP), all on
    ``torch.cuda.current_stream(q.device)``.

    ``check_seqlens``: "auto" checks cu_seqlens values on the host when that costs no sync
    (``cu_seqlens_cpu`` given or cu_seqlens on the CPU) and trusts a device-only cu_seqlens;
    "host" always checks (a device cu_seqlens is copied: a sync); "off" never checks.  Unchecked
    values are the caller's contract (non-decreasing from 0 to T; empty sequences are harmless).
    ``state_indices`` (int32 [N], device): initial/final states are pools ``[slots, H, 128, 128]``
    and sequence n uses slot ``state_indices[n]`` (< 0: zero start, no write); in place when the
    same pool is both.  The kernels bound every device value instead of trusting it: a
    cu_seqlens entry is clamped into [0, T] and a sequence's end to at least its start, an index
    outside the pool is padding; ``status`` (a one-element int32 device tensor the caller owns
    and zeroes) then gets ``layout.STATUS_*`` bits ORed in, with no sync.

    ``v_block``: V columns per serial K2 CTA (16, 32 or 64, as built); None picks 32 or 64 from
    the grid size (``specs.auto_v_block``).  ``fused``: run the serial path as the fused kernel
    (True), as K1 then K2 (False), or pick by the number of (sequence, head) items (None,
    ``specs.auto_fused``; a given ``v_block`` then means K1 then K2).

    A call signature seen before skips the structural checks (they depend on nothing else) and
    launches from cached templates: the serial path (``_SerialPlan``), or the CP chain for lengths
    and a split seen before (``_CPPlan``)."""
    if state_indices is not None and output_final_state and final_state is None:
        final_state = initial_state  # a pool's final states go back where they came from
    try:
        key = (_signature(q, k, v, g, beta, A_log, dt_bias, initial_state, final_state, out, cu_seqlens,
                          cu_seqlens_cpu, state_indices, status),
               state_layout, type(intracard_cp), intracard_cp, bool(output_final_state), check_seqlens, v_block, fused)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: validate says which
        key = plan = None
    if plan is not None:
        plan, host_cu = plan.plan_for(key, cu_seqlens, cu_seqlens_cpu)
        if plan is not None:
            return plan.run(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
                            cu_seqlens, cu_seqlens_cpu, state_indices, status, host_cu)

    c = validate(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, scale=scale,
        initial_state=initial_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        state_layout=state_layout, out=out, final_state=final_state, intracard_cp=intracard_cp,
        state_indices=state_indices, check_seqlens=check_seqlens, status=status)
    device = q.device
    heads, num_seqs = c.heads, c.num_seqs
    varlen = cu_seqlens is not None
    s_split = _resolve_split(intracard_cp, c.batch, c.seq_len, heads, cu_seqlens, c.host_cu, device)
    if s_split > 1 and c.host_cu is not None and not c.seqlens_checked:
        # A CP table is built from these host values, so they are checked whatever check_seqlens says.
        _host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, c.seq_len)
    segments = cp_plan.plan(cp_plan.sequences(c.batch, c.seq_len, c.host_cu), s_split) if s_split > 1 else None
    if segments is not None and all(len(s) == 1 for s in segments):
        segments = None  # nothing long enough to split: the serial path is the same work, faster
    loader = default_loader()
    # Resolve every kernel first: an unbuilt head count fails before anything launches.
    k1 = loader.get(device, K1Spec(heads=heads, varlen=varlen))
    indexed = state_indices is not None
    want_final = output_final_state or final_state is not None
    init_flags = _state_flags(initial_state, "init", indexed)
    alloc_final = want_final and final_state is None
    # An allocated final state is plain fp32; without want_final there is no final_state.
    final_flags = FLAG_FINAL_STATE if alloc_final else _state_flags(final_state, "final", indexed)
    status_flag = 0 if status is None else FLAG_STATUS
    if segments is None:
        if fused is None:
            fused = v_block is None and auto_fused(heads, num_seqs, c.batch * c.seq_len, _sm_count(device),
                                                   uniform=not varlen)
        # The serial decision is the signature's alone unless CP was planned from host lengths;
        # under "auto" the plan then re-plans each call (cheaply) and is kept while serial.
        fixed_decision = intracard_cp is False or c.host_cu is None or not varlen
        options = dict(cu_seqlens=cu_seqlens, alloc_final=alloc_final, state_layout=state_layout, init_flags=init_flags,
                       final_flags=final_flags, status_flag=status_flag, device=device, intracard_cp=intracard_cp,
                       split=1 if fixed_decision else None)
        if fused:
            plan = _FusedPlan(c, loader.get(device, fused_spec(heads)), **options)
        else:
            if v_block is None:
                v_block = auto_v_block(heads, num_seqs, _sm_count(device))
            plan = _SerialPlan(c, k1, loader.get(device, serial_k2_spec(heads, varlen, v_block)), **options)
        if key is not None and (fixed_decision or intracard_cp == "auto"):
            _remember(key, plan)
        return plan.run(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
                        cu_seqlens, cu_seqlens_cpu, state_indices, status, c.host_cu)
    # The CP plan is this signature's, these lengths' and this split's: a varlen call re-plans its
    # split from its lengths, a fixed-length one has them in the signature.
    plan = _CPPlan(c, loader, k1, segments, s_split, cu_seqlens=cu_seqlens, alloc_final=alloc_final,
                   state_layout=state_layout, init_flags=init_flags, final_flags=final_flags, status_flag=status_flag,
                   device=device, intracard_cp=intracard_cp, split=None if varlen else s_split)
    if key is not None:
        _remember(_cp_key(key, c.host_cu, s_split), plan)
        if key not in _PLANS:  # the signature's first plan: it reads later calls' lengths
            _remember(key, plan)
    return plan.run(q, k, v, g, beta, A_log, dt_bias, lower_bound, scale, initial_state, final_state, out,
                    cu_seqlens, cu_seqlens_cpu, state_indices, status, c.host_cu)
