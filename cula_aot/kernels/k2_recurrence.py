"""K2 "recurrence": the sequential KDA state update over the tiles of each (sequence, head).

What it computes (shared/design/SPEC.md §2), for one sequence, one head and one block of
``v_block`` value columns (the recurrence is independent across V columns), over the tiles of
the sequence in order, with the state slice ``S[:, cols]`` (128 × v_block, fp32) in registers:

    W = diag(b)·(V − kd·S)     U = INV·W
    O = qd·S + Mqk·U           S ← diag(gtot)·S + krᵀ·U

``b = σ(β)`` from the raw logits K1 stored (rows past the sequence end have β = −inf, and W is
forced to 0 there, so nothing from another sequence leaks in).  All math is fp32 on the bf16
workspace operands; the state stays fp32 between tiles (more precise than the bf16 recipe).

Inputs per tile come from K1's workspaces (slot = head · total_slots + tile slot, see
``k1_prepare``): qd, kd, kr as raw 4096-byte K_INTER images, inv, mqk, gt and beta, each with
one ``cp.async.bulk`` global→shared copy (no tensor map, no unswizzle) into one of two stages,
so tile t+1 loads while tile t computes.  v rows are read directly (masked to the sequence).

Thread layout (128 threads): thread t owns column ``t % v_block`` and key rows
``[kg·K_PER, (kg+1)·K_PER)`` with ``kg = t // v_block``; the kg groups reduce kd·S and qd·S
through shared memory.

Work items.  Serial (``segmented=False``): one per sequence, found from cu_seqlens (varlen) or
B×T (fixed) on the device.  Segmented (intracard CP, ``segmented=True``): one per row of a
segment table built by the host planner (``cula_aot.layout.SEG_*``): first token, first tile
slot, token count, the state rows it reads/writes and its flags.  The same kernel serves the CP
pre_scan (flags: identity start, v = 0, no output → the segment's transition matrix; or zero
start, real v, no output → its end state) and the segmented recurrence (start from the merged
carry).

Launch: grid (128 / v_block, H, work items), block (128, 1, 1), ``smem_bytes(v_block)`` dynamic
shared memory.  Runtime: lengths, cu_seqlens or the segment table, initial/final state strides
(``[N,H,V,K]``, ``[N,H,K,V]``) and flags (``cula_aot.layout.FLAG_*``).  Compile-time: H,
varlen, v_block, segmented.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from ..layout import (
    FLAG_FINAL_STATE,
    FLAG_IDENTITY_INIT,
    FLAG_INITIAL_STATE,
    FLAG_NO_OUTPUT,
    FLAG_ZERO_V,
    SEG_FINAL_INDEX,
    SEG_FIRST_SLOT,
    SEG_FIRST_TOKEN,
    SEG_FLAGS,
    SEG_INIT_INDEX,
    SEG_TOKENS,
    SEGMENT_FIELDS,
    WORKSPACE_SLOT_BYTES,
)
from .common import CHUNK, D, THREADS, sigmoid, state_element, varlen_sequence

# One pipeline stage: the seven per-tile workspaces back to back (each 16-byte aligned), each
# filled by one bulk copy.
_STAGE_PARTS = ("qd", "kd", "kr", "inv", "mqk", "gt", "beta")
_PART_OFFSET = {}
STAGE_BYTES = 0
for _part in _STAGE_PARTS:
    _PART_OFFSET[_part] = STAGE_BYTES
    STAGE_BYTES += WORKSPACE_SLOT_BYTES[_part]
STAGES = 2
STAGE_ALIGN = 32  # every part offset and STAGE_BYTES are multiples of this
assert STAGE_BYTES % STAGE_ALIGN == 0 and all(o % STAGE_ALIGN == 0 for o in _PART_OFFSET.values())


def smem_bytes(v_block: int) -> int:
    """Dynamic shared memory: 2 stages, kd·S/qd·S partials, W and U, barriers, alignment slack."""
    partials = 2 * CHUNK * D * 4
    w_and_u = 2 * CHUNK * v_block * 4
    return STAGES * STAGE_BYTES + partials + w_and_u + 16 + 8 * 128


def _stage_base(stages: cute.Tensor, stage):
    """Start of stage ``stage`` (dynamic) with its alignment stated, so copies stay vectorised."""
    return stages.iterator + cute.assume(stage * STAGE_BYTES, divby=STAGE_ALIGN)


def _stage_view(stage_base: cute.Pointer, part: str, dtype):
    """The ``part`` workspace inside a stage buffer, as a 1-D tensor of ``dtype``."""
    nbytes = WORKSPACE_SLOT_BYTES[part]
    ptr = cute.recast_ptr(stage_base + _PART_OFFSET[part], dtype=dtype)
    return cute.make_tensor(ptr, cute.make_layout(nbytes * 8 // dtype.width))


def _issue_stage_loads(sources, stage_base: cute.Pointer, barrier: cute.Pointer, slot):
    """One thread: arm ``barrier`` with the stage's byte count, then one bulk copy per part."""
    cute.arch.mbarrier_arrive_and_expect_tx(barrier, STAGE_BYTES)
    for part, src in zip(_STAGE_PARTS, sources):
        nbytes = WORKSPACE_SLOT_BYTES[part]
        atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), cutlass.Uint8, num_bits_per_copy=nbytes * 8)
        g_src = cute.make_tensor(cute.recast_ptr(src, dtype=cutlass.Uint8) + slot * nbytes, cute.make_layout(nbytes))
        cute.copy(atom, g_src, _stage_view(stage_base, part, cutlass.Uint8), mbar_ptr=barrier)


def _image_row8(image: cute.Tensor, row, k0):
    """Eight consecutive k of row ``row`` of a K_INTER image (k0 a multiple of 8), as fp32."""
    src = cute.make_tensor(image.iterator + (k0 // 8) * (CHUNK * 8) + row * 8, cute.make_layout(8))
    return src.load().to(cutlass.Float32)


@cute.kernel
def k2_recurrence_kernel(
    v: cute.Pointer,
    out: cute.Pointer,
    initial_state: cute.Pointer,
    final_state: cute.Pointer,
    cu_seqlens: cute.Pointer,
    segments: cute.Pointer,
    ws_qd: cute.Pointer,
    ws_kd: cute.Pointer,
    ws_kr: cute.Pointer,
    ws_gt: cute.Pointer,
    ws_inv: cute.Pointer,
    ws_mqk: cute.Pointer,
    ws_beta: cute.Pointer,
    seq_len: cutlass.Int32,
    num_seqs: cutlass.Int32,
    total_slots: cutlass.Int32,
    init_stride_k: cutlass.Int32,
    init_stride_v: cutlass.Int32,
    final_stride_k: cutlass.Int32,
    final_stride_v: cutlass.Int32,
    flags: cutlass.Int32,
    heads: cutlass.Constexpr[int],
    varlen: cutlass.Constexpr[bool],
    v_block: cutlass.Constexpr[int],
    segmented: cutlass.Constexpr[bool],
):
    groups = THREADS // v_block
    k_per = D // groups
    rows_per_thread = CHUNK // groups
    tid, _, _ = cute.arch.thread_idx()
    vblk, head, seq = cute.arch.block_idx()
    col = tid % v_block
    kg = tid // v_block
    v_col = vblk * v_block + col

    # ---- this work item: first token, first tile slot, length, state rows, flags ----------
    seq_start = cutlass.Int64(0)
    first_slot = cutlass.Int32(0)
    length = seq_len
    init_index = seq
    final_index = seq
    if cutlass.const_expr(segmented):
        row = cute.make_tensor(segments + seq * SEGMENT_FIELDS, cute.make_layout(SEGMENT_FIELDS))
        seq_start = cutlass.Int64(row[SEG_FIRST_TOKEN])
        first_slot = row[SEG_FIRST_SLOT]
        length = row[SEG_TOKENS]
        init_index = row[SEG_INIT_INDEX]
        final_index = row[SEG_FINAL_INDEX]
        flags = row[SEG_FLAGS]
    elif cutlass.const_expr(varlen):
        seq_start, first_slot, length = varlen_sequence(cu_seqlens, num_seqs, seq)
    else:
        seq_start = cutlass.Int64(seq) * cutlass.Int64(seq_len)
        first_slot = seq * ((seq_len + (CHUNK - 1)) // CHUNK)
    num_tiles = (length + (CHUNK - 1)) // CHUNK

    smem = cutlass.utils.SmemAllocator()
    s_stages = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(STAGES * STAGE_BYTES), 128)
    s_red_k = smem.allocate_tensor(cutlass.Float32, cute.make_layout((groups, CHUNK, v_block)), 16)
    s_red_q = smem.allocate_tensor(cutlass.Float32, cute.make_layout((groups, CHUNK, v_block)), 16)
    s_w = smem.allocate_tensor(cutlass.Float32, cute.make_layout((CHUNK, v_block)), 16)
    s_u = smem.allocate_tensor(cutlass.Float32, cute.make_layout((CHUNK, v_block)), 16)
    full = smem.allocate_array(cutlass.Int64, STAGES)

    # ---- state slice into registers -----------------------------------------------------
    state = cute.make_rmem_tensor(cute.make_layout(k_per), cutlass.Float32)
    state.fill(0.0)
    if (flags & FLAG_INITIAL_STATE) != 0:
        for i in cutlass.range_constexpr(k_per):
            state[i] = state_element(initial_state, init_index, heads, head, kg * k_per + i, v_col,
                                     init_stride_k, init_stride_v)[0]
    if (flags & FLAG_IDENTITY_INIT) != 0:
        for i in cutlass.range_constexpr(k_per):
            state[i] = cutlass.Float32(1.0) if kg * k_per + i == v_col else cutlass.Float32(0.0)
    zero_v = (flags & FLAG_ZERO_V) != 0
    write_out = (flags & FLAG_NO_OUTPUT) == 0

    sources = (ws_qd, ws_kd, ws_kr, ws_inv, ws_mqk, ws_gt, ws_beta)
    slot0 = cutlass.Int64(head) * cutlass.Int64(total_slots) + cutlass.Int64(first_slot)
    if tid == 0:
        for s in cutlass.range_constexpr(STAGES):
            cute.arch.mbarrier_init(full + s, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    if tid == 0:
        if num_tiles > 0:
            _issue_stage_loads(sources, s_stages.iterator, full, slot0)

    v_rows = cute.make_rmem_tensor(cute.make_layout(rows_per_thread), cutlass.Float32)
    q_s = cute.make_rmem_tensor(cute.make_layout(rows_per_thread), cutlass.Float32)
    for tile in cutlass.range(num_tiles, unroll=1):
        stage = tile % STAGES
        stage_base = _stage_base(s_stages, stage)
        # Tile t+1 loads into the other stage: the barrier ending tile t-1 freed it.
        if tid == 0:
            if tile + 1 < num_tiles:
                nxt = (tile + 1) % STAGES
                _issue_stage_loads(sources, _stage_base(s_stages, nxt), full + nxt,
                                   slot0 + cutlass.Int64(tile + 1))
        rows_valid = cutlass.min(length - tile * CHUNK, CHUNK)
        token0 = seq_start + cutlass.Int64(tile * CHUNK)
        # v for this thread's rows while the workspaces land (rows past the end read as 0).
        for m in cutlass.range_constexpr(rows_per_thread):
            r = kg + m * groups
            v_rows[m] = cutlass.Float32(0.0)
            if r < rows_valid and not zero_v:
                at = ((token0 + cutlass.Int64(r)) * heads + cutlass.Int64(head)) * D + cutlass.Int64(v_col)
                v_rows[m] = cute.make_tensor(v + at, cute.make_layout(1))[0].to(cutlass.Float32)
        cute.arch.mbarrier_wait(full + stage, (tile // STAGES) % 2)
        img_qd = _stage_view(stage_base, "qd", cutlass.BFloat16)
        img_kd = _stage_view(stage_base, "kd", cutlass.BFloat16)
        img_kr = _stage_view(stage_base, "kr", cutlass.BFloat16)
        inv = _stage_view(stage_base, "inv", cutlass.BFloat16)
        mqk = _stage_view(stage_base, "mqk", cutlass.BFloat16)
        gt = _stage_view(stage_base, "gt", cutlass.Float32)
        beta = _stage_view(stage_base, "beta", cutlass.BFloat16)

        # -- partial kd·S and qd·S over this thread's key rows ----------------------------
        for r in cutlass.range_constexpr(CHUNK):
            acc_k = cutlass.Float32(0.0)
            acc_q = cutlass.Float32(0.0)
            for i8 in cutlass.range_constexpr(k_per // 8):
                k0 = kg * k_per + i8 * 8
                kd8 = _image_row8(img_kd, r, k0)
                qd8 = _image_row8(img_qd, r, k0)
                for e in cutlass.range_constexpr(8):
                    acc_k += kd8[e] * state[i8 * 8 + e]
                    acc_q += qd8[e] * state[i8 * 8 + e]
            s_red_k[kg, r, col] = acc_k
            s_red_q[kg, r, col] = acc_q
        cute.arch.sync_threads()

        # -- W = diag(b)(V − kd·S) for this thread's rows; keep qd·S ----------------------
        for m in cutlass.range_constexpr(rows_per_thread):
            r = kg + m * groups
            ks = cutlass.Float32(0.0)
            qs = cutlass.Float32(0.0)
            for grp in cutlass.range_constexpr(groups):
                ks += s_red_k[grp, r, col]
                qs += s_red_q[grp, r, col]
            q_s[m] = qs
            b = sigmoid(beta[r].to(cutlass.Float32))
            s_w[r, col] = b * (v_rows[m] - ks) if r < rows_valid else cutlass.Float32(0.0)
        cute.arch.sync_threads()

        # -- U = INV·W --------------------------------------------------------------------
        for m in cutlass.range_constexpr(rows_per_thread):
            r = kg + m * groups
            acc = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(CHUNK):
                acc += inv[r * CHUNK + j].to(cutlass.Float32) * s_w[j, col]
            s_u[r, col] = acc
        cute.arch.sync_threads()

        # -- O = qd·S + Mqk·U ---------------------------------------------------------------
        for m in cutlass.range_constexpr(rows_per_thread):
            r = kg + m * groups
            acc = q_s[m]
            for j in cutlass.range_constexpr(CHUNK):
                acc += mqk[r * CHUNK + j].to(cutlass.Float32) * s_u[j, col]
            if r < rows_valid and write_out:
                at = ((token0 + cutlass.Int64(r)) * heads + cutlass.Int64(head)) * D + cutlass.Int64(v_col)
                cute.make_tensor(out + at, cute.make_layout(1))[0] = acc.to(cutlass.BFloat16)

        # -- S ← diag(gtot)·S + krᵀ·U -------------------------------------------------------
        u_col = cute.make_rmem_tensor(cute.make_layout(CHUNK), cutlass.Float32)
        for r in cutlass.range_constexpr(CHUNK):
            u_col[r] = s_u[r, col]
        for i8 in cutlass.range_constexpr(k_per // 8):
            k0 = kg * k_per + i8 * 8
            upd = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
            for e in cutlass.range_constexpr(8):
                upd[e] = gt[k0 + e] * state[i8 * 8 + e]
            for r in cutlass.range_constexpr(CHUNK):
                kr8 = _image_row8(img_kr, r, k0)
                for e in cutlass.range_constexpr(8):
                    upd[e] += kr8[e] * u_col[r]
            for e in cutlass.range_constexpr(8):
                state[i8 * 8 + e] = upd[e]
        # Frees this stage for tile t+2 and the shared scratch for tile t+1.
        cute.arch.sync_threads()

    if (flags & FLAG_FINAL_STATE) != 0:
        for i in cutlass.range_constexpr(k_per):
            element = state_element(final_state, final_index, heads, head, kg * k_per + i, v_col,
                                    final_stride_k, final_stride_v)
            element[0] = state[i]


@cute.jit
def k2_recurrence_launch(
    v: cute.Pointer,
    out: cute.Pointer,
    initial_state: cute.Pointer,
    final_state: cute.Pointer,
    cu_seqlens: cute.Pointer,
    segments: cute.Pointer,
    ws_qd: cute.Pointer,
    ws_kd: cute.Pointer,
    ws_kr: cute.Pointer,
    ws_gt: cute.Pointer,
    ws_inv: cute.Pointer,
    ws_mqk: cute.Pointer,
    ws_beta: cute.Pointer,
    seq_len: cutlass.Int32,
    num_seqs: cutlass.Int32,
    total_slots: cutlass.Int32,
    init_stride_k: cutlass.Int32,
    init_stride_v: cutlass.Int32,
    final_stride_k: cutlass.Int32,
    final_stride_v: cutlass.Int32,
    flags: cutlass.Int32,
    stream,
    heads: cutlass.Constexpr[int],
    varlen: cutlass.Constexpr[bool],
    v_block: cutlass.Constexpr[int],
    segmented: cutlass.Constexpr[bool],
):
    # Segmented launches: num_seqs counts the work items (segment table rows).
    k2_recurrence_kernel(
        v, out, initial_state, final_state, cu_seqlens, segments,
        ws_qd, ws_kd, ws_kr, ws_gt, ws_inv, ws_mqk, ws_beta,
        seq_len, num_seqs, total_slots, init_stride_k, init_stride_v, final_stride_k, final_stride_v, flags,
        heads, varlen, v_block, segmented,
    ).launch(grid=[D // v_block, heads, num_seqs], block=[THREADS, 1, 1], smem=smem_bytes(v_block), stream=stream)
