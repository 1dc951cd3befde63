"""K1 "prepare": per (16-token tile, head) KDA workspaces, compiled ahead of time.

What it computes (docs/CONTRACT.md §2, §3), for one tile of one sequence and one head:

* ``γ`` per key dim by the variant's ``gate``: "safe" ``lower_bound · σ(exp(A_log) · (g + dt_bias))``,
  "softplus" ``−exp(A_log) · softplus(g + dt_bias)``, "precomputed" ``min(g, 0)`` (the unbounded
  gates floored at 2^-14 per token); ``G`` its inclusive cumsum over the tile's rows,
  ``gtot = exp(G[15])``;
* ``q̂, k̂`` = L2-normalised q, k rounded to bf16 (q, k as given under ``FLAG_QK_AS_GIVEN``),
  ``b = σ(β)`` (β itself under ``FLAG_BETA_PROBABILITY``);
* ``qd = q̂·e^G·scale``, ``kd = k̂·e^G``, ``kinv = k̂·e^-G``, ``kr = k̂·e^(G[15]-G)`` (stored bf16);
* ``L = strict_lower(diag(b)·kd·kinvᵀ)``, ``Mqk = lower_incl(qd·kinvᵀ)`` on tensor cores with tf32
  operands rounded from the fp32 values (more precise than the recipe's bf16 operands; under an
  unbounded gate each pair's decay as two factors around G[15]/2, both ≤ 2^112 by the gate's
  floor, ``prepare_tile.unbounded_operands``), and
  ``INV = (I+L)^-1 = (I-L)(I+L²)(I+L⁴)(I+L⁸)`` (L is nilpotent: exact) with the recipe's fp16
  operands and fp32 accumulation, in one warp's registers (``register_inverse``).

Rows past a sequence's end behave as q = k = 0, γ = 0, b = 0.

Data layout: after the TMA loads every value lives in registers in the tf32 MMA fragment
layout.  Warp w owns key columns ``[32w, 32w + 32)``; lane (g, t) = (lane // 4, lane % 4) holds
rows g and g + 8 of the 8 consecutive columns from ``32w + 8t`` (``lane_columns``).  One 16-byte
shared read per row and tensor brings them in; row norms are lane shuffles plus a 512-byte
exchange between the warps, the cumsum over rows is a shuffle scan, and each lane's 8 columns
of a row are one 16-byte row of a K_INTER image, stored straight to global.  For L and Mqk the
contraction over keys is split by warp: the lane's values *are* A and B fragments of its warp's
32 keys once the keys are renumbered (``fragment_value``), so each warp runs 16 MMAs and the
four partial products are summed through shared memory in a fixed order: warp 0 sums L's and
inverts (I + L) in its registers, warps 2–3 sum Mqk's, with no barrier after the exchange.

Workspaces: one record of ``layout.WORKSPACE_RECORD_BYTES`` per slot (slot = head · total_slots +
tile slot), its parts at ``layout.WORKSPACE_PART_OFFSETS``:

* qd, kd, kr: 4096 B raw byte images of the bf16 16×128 tile in the K_INTER layout, element
  (r, c) at byte ``2·((c//8)·128 + r·8 + c%8)``.
* gt: fp32[128] gtot.  inv, mqk: bf16 16×16 row-major (element (i, j) at ``i·16 + j``).
* b: fp32[16] σ(β) per row, 0 for padded rows (so K2's W is 0 there with no test of its own).

Tile slots.  Fixed mode (B sequences of T tokens): slot = b·ceil(T/16) + tile.  Varlen mode
(cu_seqlens, N sequences): sequence s owns slots from ``(cu[s] + 15·s) // 16``; since
``floor((x+L+15)/16) ≥ floor(x/16) + ceil(L/16)`` the ranges never overlap, the total is
``(T + 15·N) // 16`` and a CTA finds its first slot's sequence by binary search over
cu_seqlens alone, then steps forward (``_next_tile``): no prefix scan, no extra launch, no
GPU→CPU sync.  Slots in the gaps are left unwritten.  The cu_seqlens entries are clamped
(``common.sequence_bounds``): however wrong they are, every tile stays inside the input tensors
and the CTA's own slots.

Launch: grid (ceil(total_slots / tiles_per_cta), H, 1), block (128, 1, 1), ``SMEM_BYTES``
dynamic shared memory.  A CTA walks ``tiles_per_cta`` consecutive slots of one head (a runtime
value, ``specs.k1_grid``) with two load buffers: tile i + 2's TMA loads are issued as soon as
tile i's inputs are in registers, so they fly while tiles i and i + 1 are computed.
Constraints: D = 128, CHUNK = 16, any H (the grid's); q/k/g bf16 [rows, H, 128] with heads and D
packed and any 16-byte multiple token stride (the TMA descriptors carry it, so views cut from
a fused projection need no copy), 16-byte aligned base; β bf16 [rows, H] with token stride
``beta_row_stride`` (elements); scale, lower_bound and ``flags`` (the input conventions) are
runtime scalars.
"""

import cutlass
import cutlass.cute as cute

from .common import (
    CHUNK,
    D,
    IMAGE_BYTES,
    THREADS,
    beta_weight,
    k_inter_index,
    record_part,
    sequence_bounds,
    slot_base,
    varlen_slot_sequence,
)
from ..layout import FLAG_BETA_PROBABILITY, FLAG_QK_AS_GIVEN, WORKSPACE_RECORD_BYTES
from ..specs import K1_CTAS_PER_SM
from .warp_mma import pack_bf16x2
from .gate import Gate
from .prepare_tile import (
    TokenTileKernel,
    gate_constants,
    decayed_partials,
    LANE_COLS,
    NORM_PARTIALS,
    PRODUCT_PARTIALS,
    WARP_COLS,
    copy_tiles,
    gate_cumsum,
    lane_columns,
    lane_rows,
    load_fragments,
    normalised_and_gates,
    reduce_and_invert,
    vector,
)

assert WARP_COLS == 4 * LANE_COLS  # lanes t = 0..3 of a row cover the warp's columns


SMEM_BYTES = 6 * IMAGE_BYTES + 16 + 16 + 4 * NORM_PARTIALS + 4 * PRODUCT_PARTIALS + 8 * 128
# ptxas caps registers at 128 for four CTAs per SM; five (96 registers) spills.
CTAS_PER_SM = K1_CTAS_PER_SM


@cute.jit
def _store_image_row(record: cute.Pointer, part: cutlass.Constexpr[str], values: cute.Tensor, row, col0):
    """One lane's 8 values of ``row`` as bf16 into the K_INTER image ``part``: 8 consecutive
    columns of one 8-column group are 16 contiguous bytes, one global vector store."""
    words = cute.make_rmem_tensor(cute.make_layout(LANE_COLS // 2), cutlass.Int32)
    for m in cutlass.range_constexpr(LANE_COLS // 2):
        words[m] = pack_bf16x2(values[2 * m], values[2 * m + 1])
    image = cute.recast_ptr(record_part(record, part, cutlass.BFloat16), dtype=cutlass.Int32)
    vector(image, k_inter_index(row, col0) // 2, LANE_COLS // 2).store(words.load())


@cute.jit
def _next_tile(
    cu_seqlens: cute.Pointer, num_seqs, seq_len, slot, seq, base, next_base, varlen: cutlass.Constexpr[bool]
):
    """The tile cursor: (first token, valid rows, seq, base, next_base) of tile slot ``slot``, given
    the cursor (seq, its first slot ``base``, the next sequence's ``next_base``) at an earlier
    slot of this CTA (varlen; rows ≤ 0 marks a gap slot).  Slots are visited in order, so a
    CTA searches cu_seqlens once and then steps, never past the last sequence (a well-formed
    cu_seqlens has slot_base(num_seqs) ≥ total_slots; a malformed one may not).  A malformed
    cu_seqlens only maps slots to wrong tiles: rows stay in [start, end) ⊆ [0, T), and the first
    token is ≥ 0 (slot < base only for the search's fallback, sequence 0, whose base ≤ start / 16)."""
    token0 = cutlass.Int32(0)
    rows = cutlass.Int32(0)
    if cutlass.const_expr(varlen):
        cu = cute.make_tensor(cu_seqlens, cute.make_layout(num_seqs + 1))
        while (slot >= next_base) & (seq < num_seqs - 1):
            seq = seq + 1
            base = next_base
            next_base = slot_base(cu, seq + 1, seq_len)
        start, end = sequence_bounds(cu, seq, seq_len)
        token0 = start + (slot - base) * CHUNK
        rows = cutlass.min(end - token0, CHUNK)
    else:
        tiles_per_seq = (seq_len + (CHUNK - 1)) // CHUNK
        seq = slot // tiles_per_seq
        tile = slot - seq * tiles_per_seq
        token0 = seq * seq_len + tile * CHUNK
        rows = cutlass.min(seq_len - tile * CHUNK, CHUNK)
    return token0, rows, seq, base, next_base


@cute.jit
def _publish_tile(s_info: cute.Tensor, barriers: cute.Pointer, buffer, token0, rows, lane):
    """Producer lane 0: the tile's (first token, valid rows) into ``s_info[buffer]``, then arm the
    buffer's barrier for its loads (the arrive releases s_info to the threads that wait on it)."""
    if lane == 0:
        s_info[2 * buffer] = token0
        s_info[2 * buffer + 1] = rows
        cute.arch.mbarrier_arrive_and_expect_tx(barriers + buffer, 3 * IMAGE_BYTES)


class K1Prepare(TokenTileKernel):
    """K1 of one variant (``specs.K1Spec``): the codegen arguments here, the launch in
    ``TokenTileKernel.__call__``, the device code in ``kernel`` (docs/DESIGN.md, Kernels as
    classes).  The entry symbol is the former function's, ``kernel_cutlass_k1_prepare_kernel_<the
    parameters' types, cut at 180 characters>_0``."""

    threads = THREADS
    smem_bytes = SMEM_BYTES
    min_blocks_per_mp = CTAS_PER_SM  # caps registers at 128 (ptxas .minnctapersm)

    def __init__(self, varlen: bool, gate: str):
        self.varlen = varlen
        self.gate = gate

    @cute.kernel
    def k1_prepare(
        self,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_g: cute.CopyAtom,
        beta: cute.Pointer,
        a_log: cute.Pointer,
        dt_bias: cute.Pointer,
        cu_seqlens: cute.Pointer,
        workspace: cute.Pointer,
        seq_len: cutlass.Int32,
        num_seqs: cutlass.Int32,
        total_slots: cutlass.Int32,
        beta_row_stride: cutlass.Int32,
        tiles_per_cta: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        flags: cutlass.Int32,
        token_coords: cute.Tensor,
    ):
        tid, _, _ = cute.arch.thread_idx()
        gate = Gate(self.gate)  # asked, not compared by name (kernels/gate.py)
        cta, head, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        first_slot = cta * tiles_per_cta
        count = cutlass.min(tiles_per_cta, total_slots - first_slot)
        atoms = (tma_q, tma_k, tma_g)

        smem = cutlass.utils.SmemAllocator()
        # Two load buffers of q, k, g tiles: the next tile's loads fly while this one is computed.
        s_inputs = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(2 * 3 * CHUNK * D), 128)
        load_barriers = smem.allocate_array(cutlass.Int64, 2)
        s_info = smem.allocate_tensor(cutlass.Int32, cute.make_layout(4), 16)
        s_norm = smem.allocate_tensor(cutlass.Float32, cute.make_layout(NORM_PARTIALS), 16)
        s_part = smem.allocate_tensor(cutlass.Float32, cute.make_layout(PRODUCT_PARTIALS), 16)

        # ---- TMA: this CTA's first two tiles --------------------------------------------------
        # Warp 0 is the producer: it walks the tile cursor over the CTA's slots in order, and for
        # each tile records (first token, valid rows) in s_info[buffer] before arming the buffer's
        # barrier (its arrive releases them to the threads that wait on it) and issuing the loads.
        # Rows past a sequence's end (the next sequence, or zero fill past the tensor) are masked
        # in compute; a gap slot's tiles are loaded too, so every buffer use has one completion.
        if tid == 0:
            for b in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(load_barriers + b, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        seq = cutlass.Int32(0)
        base = cutlass.Int32(0)
        next_base = cutlass.Int32(0)
        if cute.arch.warp_idx() == 0:
            if cutlass.const_expr(self.varlen):
                cu = cute.make_tensor(cu_seqlens, cute.make_layout(num_seqs + 1))
                seq = varlen_slot_sequence(cu_seqlens, num_seqs, first_slot, seq_len)
                base = slot_base(cu, seq, seq_len)
                next_base = slot_base(cu, seq + 1, seq_len)
            for b in cutlass.range_constexpr(2):
                if b < count:
                    token0, rows, seq, base, next_base = _next_tile(
                        cu_seqlens, num_seqs, seq_len, first_slot + b, seq, base, next_base, self.varlen
                    )
                    _publish_tile(s_info, load_barriers, b, token0, rows, lane)
                    copy_tiles(atoms, token_coords, s_inputs, b, load_barriers + b, token0, head)

        col0 = lane_columns(warp, lane)
        my_rows = lane_rows(lane)
        gate_scale, gate_bias, gamma_scale, has_source = gate_constants(
            a_log, dt_bias, head, col0, lower_bound, lane, gate
        )
        beta_probability = (flags & FLAG_BETA_PROBABILITY) != 0
        qk_as_given = (flags & FLAG_QK_AS_GIVEN) != 0
        for i in range(count):
            slot = first_slot + i
            buffer = i % 2
            slot_index = cutlass.Int64(head) * cutlass.Int64(total_slots) + cutlass.Int64(slot)
            record = workspace + cute.assume(slot_index * WORKSPACE_RECORD_BYTES, divby=16)
            cute.arch.mbarrier_wait(load_barriers + buffer, (i // 2) % 2)
            token0 = s_info[2 * buffer]
            rows = s_info[2 * buffer + 1]

            # ---- phase A: the lane's fragments, row norms (shuffles + a cross-warp exchange) ------
            valid, vq, vk, vg = load_fragments(s_inputs.iterator, buffer, my_rows, col0, rows, s_norm, warp)
            # β of rows tid < 16: loaded here, used only at the end of phase C, so their global
            # latency overlaps phases A-C instead of holding the next barrier.
            beta_row = cutlass.Float32(0.0)
            if tid < rows:
                if tid < CHUNK:
                    # A one-element view at the element itself: a size-1 layout has stride 0.
                    beta_at = (
                        beta + (cutlass.Int64(token0) + tid) * cutlass.Int64(beta_row_stride) + cutlass.Int64(head)
                    )
                    beta_row = cute.make_tensor(beta_at, cute.make_layout(1))[0].to(cutlass.Float32)
            cute.arch.sync_threads()
            # Every thread has read this buffer and its s_info: refill both with tile i + 2.
            if cute.arch.warp_idx() == 0:
                if i + 2 < count:
                    next_token0, next_rows, seq, base, next_base = _next_tile(
                        cu_seqlens, num_seqs, seq_len, slot + 2, seq, base, next_base, self.varlen
                    )
                    _publish_tile(s_info, load_barriers, buffer, next_token0, next_rows, lane)
                    copy_tiles(atoms, token_coords, s_inputs, buffer, load_barriers + buffer, next_token0, head)

            if rows > 0:
                # ---- phase B: q̂, k̂, γ (log2 units), the cumsum G over rows and the decayed operands --
                qhat, khat, gamma = normalised_and_gates(
                    vq, vk, vg, valid, s_norm, my_rows, gate_scale, gate_bias, gamma_scale, gate, qk_as_given
                )
                cum, total, gtot = gate_cumsum(gamma, has_source, lane)
                if lane < 4:
                    vector(record_part(record, "gt", cutlass.Float32), col0, LANE_COLS).store(gtot.load())

                def store_images(half, qd, kd, kr):
                    for part, values in (("qd", qd), ("kd", kd), ("kr", kr)):
                        _store_image_row(record, part, values, my_rows[half], col0)

                # The bf16 images go to the workspaces; L and Mqk take the fp32 values as tf32 operands.
                # ---- phase C: L and Mqk, split over keys by warp ------------------------------------
                decayed_partials(qhat, khat, cum, total, gtot, scale, store_images, s_part, warp, lane, gate)
                b = cutlass.Float32(0.0)
                if warp == 0:
                    b = cutlass.Float32(
                        cutlass.select_(tid < rows, beta_weight(beta_row, beta_probability), cutlass.Float32(0.0))
                    )
                    if lane < CHUNK:
                        cute.make_tensor(record_part(record, "b", cutlass.Float32), cute.make_layout(CHUNK))[lane] = b
                cute.arch.sync_threads()

                # ---- phase D: INV = (I - L)(I + L²)(I + L⁴)(I + L⁸) in warp 0's registers -----------
                # (it sums L's partials first); warps 2-3 sum Mqk's meanwhile.  No barrier: the next
                # tile's exchange is written after its phase A barrier, which warp 0 reaches last.
                reduce_and_invert(lambda name, dtype: record_part(record, name, dtype), s_part, b, warp, 0, lane)

    kernel = k1_prepare
