"""K1 "prepare": per (16-token tile, head) KDA workspaces, compiled ahead of time.

What it computes (shared/design/SPEC.md §2, §3), for one tile of one sequence and one head:

* ``γ = lower_bound · σ(exp(A_log) · (g + dt_bias))`` per key dim, ``G`` its inclusive cumsum
  over the tile's rows, ``gtot = exp(G[15])``;
* ``q̂, k̂`` = L2-normalised q, k rounded to bf16, ``b = σ(β)``;
* ``qd = q̂·e^G·scale``, ``kd = k̂·e^G``, ``kinv = k̂·e^-G``, ``kr = k̂·e^(G[15]-G)`` (stored bf16);
* ``L = strict_lower(diag(b)·kd·kinvᵀ)``, ``Mqk = lower_incl(qd·kinvᵀ)`` on tensor cores with tf32
  operands rounded from the fp32 values (more precise than the recipe's bf16 operands), and
  ``INV = (I+L)^-1 = (I-L)(I+L²)(I+L⁴)(I+L⁸)`` (L is nilpotent: exact) with tf32 products and
  fp32 accumulation (the recipe's fp16 has the same 10-bit mantissa and less range).

Rows past a sequence's end behave as q = k = 0, γ = 0, β = -inf.

Workspaces: one record of ``layout.WORKSPACE_RECORD_BYTES`` per slot (slot = head · total_slots +
tile slot; see ``slot_base`` below), its parts at ``layout.WORKSPACE_PART_OFFSETS``:

* qd, kd, kr: 4096 B raw byte images of the bf16 16×128 tile in the K_INTER layout, element
  (r, c) at byte ``2·((c//8)·128 + r·8 + c%8)``; each written with one ``cp.async.bulk``
  shared→global copy.
* gt: fp32[128] gtot.  inv, mqk: bf16 16×16 row-major (element (i, j) at ``i·16 + j``).
* b: fp32[16] σ(β) per row, 0 for padded rows (so K2's W is 0 there with no test of its own).

Tile slots.  Fixed mode (B sequences of T tokens): slot = b·ceil(T/16) + tile.  Varlen mode
(cu_seqlens, N sequences): sequence s owns slots from ``(cu[s] + 15·s) // 16``; since
``floor((x+L+15)/16) ≥ floor(x/16) + ceil(L/16)`` the ranges never overlap, the total is
``(T + 15·N) // 16`` and a CTA finds its sequence by binary search over cu_seqlens alone:
no prefix scan, no extra launch, no GPU→CPU sync.  Slots in the gaps are left unwritten.

Launch: grid (total_slots, H, 1), block (128, 1, 1), ``SMEM_BYTES`` dynamic shared memory.
Constraints: D = 128, CHUNK = 16, H compile-time; q/k/g bf16 [rows, H, 128] with heads and D
packed and any 16-byte multiple token stride (the TMA descriptors carry it, so views cut from
a fused projection need no copy), 16-byte aligned base; β bf16 [rows, H] with token stride
``beta_row_stride`` (elements); scale and lower_bound are runtime scalars.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .common import (
    CHUNK,
    D,
    IMAGE_BYTES,
    LOG2E,
    ROW_CHUNK_COLS,
    ROW_CHUNKS,
    ROW_THREADS,
    THREADS,
    exp2_fast,
    k_inter_index,
    input_tile_layout,
    make_token_tma,
    record_part,
    row_chunk_column,
    sigmoid,
    tile_row_as_f32,
    varlen_slot_lookup,
)
from ..layout import WORKSPACE_RECORD_BYTES
from .warp_mma import f32_bits, mma_tf32_m16n8k8, pack_bf16x2, tf32_ready, to_tf32

assert ROW_THREADS * CHUNK == THREADS  # phase A: one row per 8 threads
# Phase B2: a warp's lanes as B2_ROWS rows × B2_COLS columns.
B2_ROWS = 8
B2_COLS = 4

# Shared memory plan, in allocation order (bytes): the TMA-loaded q, k, g tiles (bf16 16×128
# row-major; phase B reuses them for the qd, kd, kr K_INTER images, since phase A has read them
# into registers) and their mbarrier, q̂, k̂, γ (fp32 16×128 each), b (fp32[16]), L and the
# Neumann ping-pong buffers.  Small enough (with ≤ 128 registers) for 4 CTAs per SM.
# fp32 16×128 tiles with rows padded by 4 words: row-parallel 16-byte reads of 16 rows at one
# column spread over the banks instead of hitting one.
F32_ROW = D + 4
_F32_TILE = CHUNK * F32_ROW * 4
# fp32 16×16 matrices, rows padded to 20 words: the tf32 A/B fragment loads hit distinct banks.
SMALL_ROW = CHUNK + 4
_F32_SMALL = CHUNK * SMALL_ROW * 4
SMEM_BYTES = 3 * IMAGE_BYTES + 8 + 3 * _F32_TILE + CHUNK * 4 + 5 * _F32_SMALL + 8 * 128
CTAS_PER_SM = 4


@cute.jit
def _fragment_product(a: cute.Tensor, b_rows: cute.Tensor, b_transposed: cutlass.Constexpr[bool], k_steps: int,
                      n_tile, lane, acc: cute.Tensor, a_ready: cutlass.Constexpr[bool] = False,
                      b_ready: cutlass.Constexpr[bool] = False):
    """acc += a · b[:, 8·n_tile : 8·n_tile + 8] on tensor cores (tf32 operands, fp32 C fragment).

    ``a`` is a 16 × 8·k_steps fp32 smem matrix; ``b`` is ``b_rows`` itself (8·k_steps × 16), or its
    transpose when ``b_transposed`` (then ``b_rows`` is 16 × 8·k_steps, e.g. kinv for ·kinvᵀ).
    ``a_ready`` / ``b_ready``: that operand was stored with ``tf32_ready`` (no conversion per load).
    Two accumulation chains (even and odd k-steps) halve the dependent MMA latency.
    """
    a_operand = f32_bits if cutlass.const_expr(a_ready) else to_tf32
    b_operand = f32_bits if cutlass.const_expr(b_ready) else to_tf32
    g = lane // 4
    t = lane % 4
    n = n_tile * 8 + g
    odd = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
    odd.fill(0.0)
    for ks in cutlass.range_constexpr(k_steps):
        k0 = ks * 8
        frag_a = [a_operand(a[g, k0 + t]), a_operand(a[g + 8, k0 + t]), a_operand(a[g, k0 + t + 4]),
                  a_operand(a[g + 8, k0 + t + 4])]
        if cutlass.const_expr(b_transposed):
            frag_b = [b_operand(b_rows[n, k0 + t]), b_operand(b_rows[n, k0 + t + 4])]
        else:
            frag_b = [b_operand(b_rows[k0 + t, n]), b_operand(b_rows[k0 + t + 4, n])]
        chain = acc if ks % 2 == 0 else odd
        d = mma_tf32_m16n8k8(frag_a, frag_b, [chain[c] for c in range(4)])
        for c in cutlass.range_constexpr(4):
            chain[c] = d[c]
    for c in cutlass.range_constexpr(4):
        acc[c] = acc[c] + odd[c]


@cute.jit
def _p_plus_p_times_x(p: cute.Tensor, x: cute.Tensor, n_tile, lane, acc: cute.Tensor):
    """acc = (p + p·x)[:, 8·n_tile : 8·n_tile + 8] as a C fragment (p, x: fp32 16×16 smem, x
    stored ``tf32_ready``), one Neumann factor (I + X) applied to the running product P."""
    for c in cutlass.range_constexpr(4):
        i, j = _fragment_entry(lane, n_tile, c)
        acc[c] = p[i, j]
    _fragment_product(p, x, False, 2, n_tile, lane, acc, b_ready=True)


def _fragment_entry(lane, n_tile, c: int):
    """(row, column) of value ``c`` of this lane's 16×8 C fragment of n-tile ``n_tile``."""
    return lane // 4 + 8 * (c // 2), n_tile * 8 + 2 * (lane % 4) + c % 2


def _store_fragment_bf16(matrix: cute.Pointer, acc: cute.Tensor, n_tile, lane):
    """This lane's C fragment of n-tile ``n_tile`` into a row-major bf16 16×16 global matrix:
    values 2h, 2h + 1 are adjacent columns, so each pair is one 4-byte store."""
    words = cute.make_tensor(cute.recast_ptr(matrix, dtype=cutlass.Int32), cute.make_layout(CHUNK * CHUNK // 2))
    for pair in range(2):
        i, j = _fragment_entry(lane, n_tile, 2 * pair)
        words[(i * CHUNK + j) // 2] = pack_bf16x2(acc[2 * pair], acc[2 * pair + 1])


@cute.kernel
def k1_prepare_kernel(
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
    scale: cutlass.Float32,
    lower_bound: cutlass.Float32,
    token_coords: cute.Tensor,
    heads: cutlass.Constexpr[int],
    varlen: cutlass.Constexpr[bool],
):
    tid, _, _ = cute.arch.thread_idx()
    slot, head, _ = cute.arch.block_idx()

    # ---- which sequence / tile this CTA owns -------------------------------------------
    seq_start = cutlass.Int64(0)
    tile = cutlass.Int32(0)
    rows = cutlass.Int32(0)
    if cutlass.const_expr(varlen):
        seq_start, tile, rows = varlen_slot_lookup(cu_seqlens, num_seqs, slot)
    else:
        tiles_per_seq = (seq_len + (CHUNK - 1)) // CHUNK
        seq = slot // tiles_per_seq
        tile = slot - seq * tiles_per_seq
        seq_start = cutlass.Int64(seq) * cutlass.Int64(seq_len)
        rows = cutlass.min(seq_len - tile * CHUNK, CHUNK)

    if rows > 0:
        smem = cutlass.utils.SmemAllocator()
        s_inputs = [smem.allocate_tensor(cutlass.BFloat16, input_tile_layout(), 128) for _ in range(3)]
        load_barrier = smem.allocate_array(cutlass.Int64, 1)
        # q̂, k̂, γ; phase B overwrites them in place with fp32 qd, kd, kinv for phase C.
        f32_tile = cute.make_layout((CHUNK, D), stride=(F32_ROW, 1))
        s_qhat = smem.allocate_tensor(cutlass.Float32, f32_tile, 128)
        s_khat = smem.allocate_tensor(cutlass.Float32, f32_tile, 128)
        s_gamma = smem.allocate_tensor(cutlass.Float32, f32_tile, 128)
        image_layout = cute.make_layout(CHUNK * D)
        s_qd, s_kd, s_kr = (cute.make_tensor(t.iterator, image_layout) for t in s_inputs)
        s_b = smem.allocate_tensor(cutlass.Float32, cute.make_layout(CHUNK), 16)
        small = cute.make_layout((CHUNK, CHUNK), stride=(SMALL_ROW, 1))
        s_l = smem.allocate_tensor(cutlass.Float32, small, 16)
        s_x0 = smem.allocate_tensor(cutlass.Float32, small, 16)
        s_x1 = smem.allocate_tensor(cutlass.Float32, small, 16)
        s_p0 = smem.allocate_tensor(cutlass.Float32, small, 16)
        s_p1 = smem.allocate_tensor(cutlass.Float32, small, 16)

        slot_index = cutlass.Int64(head) * cutlass.Int64(total_slots) + cutlass.Int64(slot)
        record = workspace + cute.assume(slot_index * WORKSPACE_RECORD_BYTES, divby=16)
        token0 = seq_start + cutlass.Int64(tile * CHUNK)

        # ---- TMA: the q, k, g tiles of rows [token0, token0 + 16) of this head -------------
        # Rows past the sequence end (the next sequence, or zero fill past the tensor) are
        # masked below.
        if tid == 0:
            cute.arch.mbarrier_init(load_barrier, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(load_barrier, 3 * IMAGE_BYTES)
        if cute.arch.warp_idx() == 0:
            origin = (cutlass.Int32(token0), head * D)
            g_tile = cute.local_tile(cute.domain_offset(origin, token_coords), (CHUNK, D), (0, 0))
            for atom, s_tile in ((tma_q, s_inputs[0]), (tma_k, s_inputs[1]), (tma_g, s_inputs[2])):
                t_smem, t_gmem = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2), cute.group_modes(g_tile, 0, 2)
                )
                cute.copy(atom, t_gmem, t_smem, tma_bar_ptr=load_barrier)
        cute.arch.mbarrier_wait(load_barrier, 0)

        # ---- phase A: row-wise l2norm, gate and β (8 threads per row, see ROW_THREADS) -----
        row = tid // ROW_THREADS
        lane_in_row = tid % ROW_THREADS
        row_valid = row < rows
        vq = tile_row_as_f32(s_inputs[0], row, lane_in_row, row_valid)
        vk = tile_row_as_f32(s_inputs[1], row, lane_in_row, row_valid)
        vg = tile_row_as_f32(s_inputs[2], row, lane_in_row, row_valid)

        # Chunk partials summed in pairs, (0 + 1) + (2 + 3): the same bits in either visiting order.
        ssq_chunk = [cutlass.Float32(0.0) for _ in range(ROW_CHUNKS)]
        ssk_chunk = [cutlass.Float32(0.0) for _ in range(ROW_CHUNKS)]
        for m in cutlass.range_constexpr(ROW_CHUNKS):
            for e in cutlass.range_constexpr(ROW_CHUNK_COLS):
                c = m * ROW_CHUNK_COLS + e
                ssq_chunk[m] = ssq_chunk[m] + vq[c] * vq[c]
                ssk_chunk[m] = ssk_chunk[m] + vk[c] * vk[c]
        ssq = (ssq_chunk[0] + ssq_chunk[1]) + (ssq_chunk[2] + ssq_chunk[3])
        ssk = (ssk_chunk[0] + ssk_chunk[1]) + (ssk_chunk[2] + ssk_chunk[3])
        for offset in cutlass.range_constexpr(3):
            ssq += cute.arch.shuffle_sync_bfly(ssq, offset=1 << offset)
            ssk += cute.arch.shuffle_sync_bfly(ssk, offset=1 << offset)
        rq = cute.math.rsqrt(ssq + 1e-6)
        rk = cute.math.rsqrt(ssk + 1e-6)

        decay_rate = cute.math.exp(cute.make_tensor(a_log, cute.make_layout(heads))[head])
        chunk_q = cute.make_rmem_tensor(cute.make_layout(ROW_CHUNK_COLS), cutlass.Float32)
        chunk_k = cute.make_rmem_tensor(cute.make_layout(ROW_CHUNK_COLS), cutlass.Float32)
        chunk_g = cute.make_rmem_tensor(cute.make_layout(ROW_CHUNK_COLS), cutlass.Float32)
        for m in cutlass.range_constexpr(ROW_CHUNKS):
            col = row_chunk_column(lane_in_row, m, row)
            g_bias = cute.make_tensor(dt_bias + head * D + cute.assume(col, divby=ROW_CHUNK_COLS),
                                      cute.make_layout(ROW_CHUNK_COLS)).load()
            for e in cutlass.range_constexpr(ROW_CHUNK_COLS):
                c = m * ROW_CHUNK_COLS + e
                chunk_q[e] = (vq[c] * rq).to(cutlass.BFloat16).to(cutlass.Float32)
                chunk_k[e] = (vk[c] * rk).to(cutlass.BFloat16).to(cutlass.Float32)
                # γ in log2 units: phase B's decays are then single ex2 instructions.
                gamma2 = lower_bound * sigmoid(decay_rate * (vg[c] + g_bias[e])) * cutlass.Float32(LOG2E)
                chunk_g[e] = gamma2 if row_valid else cutlass.Float32(0.0)
            # One 16-byte store per chunk: a row's 8 threads write 128 contiguous bytes.
            at = cute.assume(row * F32_ROW + col, divby=ROW_CHUNK_COLS)
            for dst, chunk in ((s_qhat, chunk_q), (s_khat, chunk_k), (s_gamma, chunk_g)):
                cute.make_tensor(dst.iterator + at, cute.make_layout(ROW_CHUNK_COLS)).store(chunk.load())

        if lane_in_row == 0:
            logit = cutlass.Float32(-float("inf"))
            if row_valid:
                # A one-element view at the element itself: a size-1 layout has stride 0.
                beta_at = beta + (token0 + cutlass.Int64(row)) * cutlass.Int64(beta_row_stride) + cutlass.Int64(head)
                logit = cute.make_tensor(beta_at, cute.make_layout(1))[0].to(cutlass.Float32)
            b = sigmoid(logit)
            s_b[row] = b
            cute.make_tensor(record_part(record, "b", cutlass.Float32), cute.make_layout(CHUNK))[row] = b
        cute.arch.sync_threads()

        # ---- phase B: column-wise cumsum (log2 units) and decayed operands --------------------
        # B1, thread = column: G (inclusive cumsum of γ) in place of γ, and gtot.
        col = tid
        cum = cutlass.Float32(0.0)
        for r in cutlass.range_constexpr(CHUNK):
            cum += s_gamma[r, col]
            s_gamma[r, col] = cum
        out_gt = cute.make_tensor(record_part(record, "gt", cutlass.Float32), cute.make_layout(D))
        out_gt[col] = exp2_fast(cum)
        # B2: warp w still owns columns 32w..32w+31 (so a warp barrier suffices), now as 8 passes
        # of 4 columns × 16 rows: lane (q, cl) takes rows q and q+8 of column 4·pass + cl.  A
        # warp's K_INTER stores then cover 8 consecutive rows of one 8-column group (128 bytes,
        # one wavefront) where a row-at-a-time column store hit the same 4 banks from 4 groups.
        # The bf16 images go to the workspaces; L and Mqk use the fp32 values (kept in place of
        # q̂, k̂, G), so they do not inherit the operands' bf16 rounding: with cancellation in
        # q̂·k̂ that rounding can dominate a 16×16 entry.  Those are stored as tf32-ready operands,
        # the form phase C's MMAs take.
        warp = tid // 32
        lane = tid % 32
        quad_row = lane // B2_COLS
        pass_cols = [warp * 32 + B2_COLS * p + lane % B2_COLS for p in range(32 // B2_COLS)]
        # k_inter_index is additive here: no carry between the lane's part and the pass's part.
        image_base = k_inter_index(quad_row, warp * 32 + lane % B2_COLS)
        totals = [s_gamma[CHUNK - 1, c] for c in pass_cols]
        cute.arch.sync_warp()
        for p in cutlass.range_constexpr(32 // B2_COLS):
            c = pass_cols[p]
            for half in cutlass.range_constexpr(CHUNK // B2_ROWS):
                r = quad_row + B2_ROWS * half
                cum = s_gamma[r, c]
                qh = s_qhat[r, c]
                kh = s_khat[r, c]
                idx = image_base + k_inter_index(B2_ROWS * half, B2_COLS * p)
                qd = qh * exp2_fast(cum) * scale
                kd = kh * exp2_fast(cum)
                s_qd[idx] = qd.to(cutlass.BFloat16)
                s_kd[idx] = kd.to(cutlass.BFloat16)
                s_kr[idx] = (kh * exp2_fast(totals[p] - cum)).to(cutlass.BFloat16)
                s_qhat[r, c] = tf32_ready(qd)
                s_khat[r, c] = tf32_ready(kd)
                s_gamma[r, c] = tf32_ready(kh * exp2_fast(-cum))

        # The bulk copy engine reads the images through the async proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        bulk_s2g = cute.make_copy_atom(cpasync.CopyBulkS2GOp(), cutlass.BFloat16, num_bits_per_copy=IMAGE_BYTES * 8)
        if tid == 0:
            # CuTeDSL 4.8.1 does not elect a lane for CopyBulkS2GOp: one thread issues.
            for src, part in ((s_qd, "qd"), (s_kd, "kd"), (s_kr, "kr")):
                g_img = cute.make_tensor(record_part(record, part, cutlass.BFloat16), image_layout)
                cute.copy(bulk_s2g, src, g_img)
            cute.arch.cp_async_bulk_commit_group()

        # ---- phase C: L and Mqk on tensor cores; warp w: product w // 2 (L from kd, Mqk from
        # qd, both · kinvᵀ), columns of n-tile w % 2 -----------------------------------------
        half_n = warp % 2
        acc = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
        acc.fill(0.0)
        if warp < 2:
            _fragment_product(s_khat, s_gamma, True, D // 8, half_n, lane, acc, a_ready=True, b_ready=True)
            for c in cutlass.range_constexpr(4):
                i, j = _fragment_entry(lane, half_n, c)
                s_l[i, j] = s_b[i] * acc[c] if j < i else cutlass.Float32(0.0)
        else:
            _fragment_product(s_qhat, s_gamma, True, D // 8, half_n, lane, acc, a_ready=True, b_ready=True)
            for c in cutlass.range_constexpr(4):
                i, j = _fragment_entry(lane, half_n, c)
                acc[c] = acc[c] if j <= i else cutlass.Float32(0.0)
            _store_fragment_bf16(record_part(record, "mqk", cutlass.BFloat16), acc, half_n, lane)
        cute.arch.sync_threads()

        # ---- phase D: INV = (I - L)(I + L²)(I + L⁴)(I + L⁸) ---------------------------------
        # Round 0: warps 0-1 X0 = L·L (one n-tile each), warps 2-3 P0 = I - L.  Rounds 1-2:
        # warps 0-1 P ← P + P·X, warps 2-3 X ← X·X (ping-pong buffers).  Round 3: INV = P + P·X.
        # X is only ever an MMA operand, so it is stored tf32_ready; P and L are also summed as
        # values (P + P·X, I - L) and keep full fp32.
        if warp < 2:
            acc.fill(0.0)
            _fragment_product(s_l, s_l, False, 2, half_n, lane, acc)
            for c in cutlass.range_constexpr(4):
                i, j = _fragment_entry(lane, half_n, c)
                s_x0[i, j] = tf32_ready(acc[c])
        else:
            for e in cutlass.range_constexpr(4):
                flat = (tid - 64) * 4 + e
                i = flat // CHUNK
                j = flat % CHUNK
                s_p0[i, j] = (cutlass.Float32(1.0) if i == j else cutlass.Float32(0.0)) - s_l[i, j]
        cute.arch.sync_threads()
        for step in cutlass.range_constexpr(2):
            p_src, x_src = (s_p0, s_x0) if step == 0 else (s_p1, s_x1)
            p_dst, x_dst = (s_p1, s_x1) if step == 0 else (s_p0, s_x0)
            if warp < 2:
                _p_plus_p_times_x(p_src, x_src, half_n, lane, acc)
                for c in cutlass.range_constexpr(4):
                    i, j = _fragment_entry(lane, half_n, c)
                    p_dst[i, j] = acc[c]
            else:
                acc.fill(0.0)
                _fragment_product(x_src, x_src, False, 2, half_n, lane, acc, a_ready=True, b_ready=True)
                for c in cutlass.range_constexpr(4):
                    i, j = _fragment_entry(lane, half_n, c)
                    x_dst[i, j] = tf32_ready(acc[c])
            cute.arch.sync_threads()
        if warp < 2:
            _p_plus_p_times_x(s_p0, s_x0, half_n, lane, acc)
            _store_fragment_bf16(record_part(record, "inv", cutlass.BFloat16), acc, half_n, lane)

        if tid == 0:
            # Shared memory must outlive the bulk reads of the images.
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def k1_prepare_launch(
    q: cute.Pointer,
    k: cute.Pointer,
    g: cute.Pointer,
    beta: cute.Pointer,
    a_log: cute.Pointer,
    dt_bias: cute.Pointer,
    cu_seqlens: cute.Pointer,
    workspace: cute.Pointer,
    seq_len: cutlass.Int32,
    num_seqs: cutlass.Int32,
    total_slots: cutlass.Int32,
    beta_row_stride: cutlass.Int32,
    scale: cutlass.Float32,
    lower_bound: cutlass.Float32,
    stream,
    heads: cutlass.Constexpr[int],
    varlen: cutlass.Constexpr[bool],
):
    # The descriptors built here only fix the kernel's parameter types: the runtime encodes
    # the real ones per call from the manifest recipe (specs.token_tma_recipe).
    tma_q, token_coords = make_token_tma(q, heads)
    tma_k, _ = make_token_tma(k, heads)
    tma_g, _ = make_token_tma(g, heads)
    k1_prepare_kernel(
        tma_q, tma_k, tma_g, beta, a_log, dt_bias, cu_seqlens,
        workspace,
        seq_len, num_seqs, total_slots, beta_row_stride, scale, lower_bound, token_coords, heads, varlen,
    ).launch(grid=[total_slots, heads, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, stream=stream,
             # Caps registers at 128 (ptxas .minnctapersm); the carveout is given so that tracing
             # does not ask a GPU for the SM's shared memory (the runtime sets it on load).
             min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100)
