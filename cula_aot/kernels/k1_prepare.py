"""K1 "prepare": per (16-token tile, head) KDA workspaces, compiled ahead of time.

What it computes (docs/CONTRACT.md §2, §3), for one tile of one sequence and one head:

* ``γ = lower_bound · σ(exp(A_log) · (g + dt_bias))`` per key dim, ``G`` its inclusive cumsum
  over the tile's rows, ``gtot = exp(G[15])``;
* ``q̂, k̂`` = L2-normalised q, k rounded to bf16, ``b = σ(β)``;
* ``qd = q̂·e^G·scale``, ``kd = k̂·e^G``, ``kinv = k̂·e^-G``, ``kr = k̂·e^(G[15]-G)`` (stored bf16);
* ``L = strict_lower(diag(b)·kd·kinvᵀ)``, ``Mqk = lower_incl(qd·kinvᵀ)`` on tensor cores with tf32
  operands rounded from the fp32 values (more precise than the recipe's bf16 operands), and
  ``INV = (I+L)^-1 = (I-L)(I+L²)(I+L⁴)(I+L⁸)`` (L is nilpotent: exact) with the recipe's fp16
  operands and fp32 accumulation, in one warp's registers (``_register_inverse``).

Rows past a sequence's end behave as q = k = 0, γ = 0, β = -inf.

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
    THREADS,
    exp2_fast,
    k_inter_index,
    INPUT_BLOCKS,
    input_tile_layout,
    input_element_offset,
    make_token_tma,
    record_part,
    sequence_bounds,
    sigmoid,
    slot_base,
    varlen_slot_sequence,
)
from ..layout import WORKSPACE_RECORD_BYTES
from ..specs import K1_CTAS_PER_SM
from .warp_mma import (f32_bits, mma_f16_m16n8k16, mma_tf32_m16n8k8, movmatrix_trans, pack_bf16x2, pack_f16x2,
                       tf32_ready)

WARPS = THREADS // 32
# The fragment layout: a warp's key columns, and the consecutive columns of one lane's row.
WARP_COLS = D // WARPS
LANE_COLS = 8
K_STEPS = WARP_COLS // 8  # m16n8k8 k-steps over a warp's columns
assert WARP_COLS == 4 * LANE_COLS  # lanes t = 0..3 of a row cover the warp's columns


def lane_rows(lane) -> tuple:
    """The two tile rows lane ``lane`` holds (the tf32 A fragment's rows g and g + 8)."""
    return lane // 4, lane // 4 + 8


def lane_columns(warp, lane):
    """First of the 8 consecutive key columns lane ``lane`` of warp ``warp`` holds in each row."""
    return WARP_COLS * warp + LANE_COLS * (lane % 4)


def last_row_lane(lane):
    """The lane holding rows 7 and 15 of lane ``lane``'s columns (its scan totals)."""
    return 4 * (CHUNK // 2 - 1) + lane % 4


def fragment_value(k_step: int, upper: int) -> int:
    """Which of a lane's 8 values of a row is its k = t (``upper`` 0) or k = t + 4 (1) element of
    k-step ``k_step``: logical key t of step s is column ``lane_columns + 2s``, key t + 4 the next
    column.  A bijection of the warp's 32 columns, applied to A and B alike, so the product is
    the same contraction in another order of keys."""
    return 2 * k_step + upper


# Shared memory plan, in allocation order (bytes): two load buffers of TMA-loaded q, k, g tiles
# (bf16 16×128 as four 16×32 row-major blocks, ``input_tile_layout``), their two mbarriers,
# s_info (each buffer's first token and valid rows, from the producer), the norms' cross-warp
# partial sums (fp32 [q/k][row][warp]) and the warps' partial L/Mqk fragments (fp32, per warp,
# product, n-tile: one 16-byte word per lane and value group).  Phase D needs none: it runs in warp 0's registers.
NORM_PARTIALS = 2 * CHUNK * WARPS
PRODUCT_PARTIALS = WARPS * 2 * 2 * 32 * 4
SMEM_BYTES = 6 * IMAGE_BYTES + 16 + 16 + 4 * NORM_PARTIALS + 4 * PRODUCT_PARTIALS + 8 * 128
# ptxas caps registers at 128 for four CTAs per SM; five (96 registers) spills.
CTAS_PER_SM = K1_CTAS_PER_SM


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


def _vector(base: cute.Pointer, offset, count: int) -> cute.Tensor:
    """``count`` consecutive elements at ``base + offset`` (``offset`` a multiple of ``count``),
    so that loads and stores of the whole view are single vector accesses."""
    return cute.make_tensor(base + cute.assume(offset, divby=count), cute.make_layout(count))


@cute.jit
def _lane_row_values(tile: cute.Pointer, row, col0, valid):
    """The 8 bf16 elements of input tile ``tile`` at (row, col0 .. col0 + 7) as fp32 (one 16-byte
    shared read), zeros if not ``valid`` (``True``: no mask)."""
    raw = _vector(tile, input_element_offset(row, col0), LANE_COLS).load().to(cutlass.Float32)
    out = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    for j in cutlass.range_constexpr(LANE_COLS):
        if cutlass.const_expr(valid is True):
            out[j] = raw[j]
        else:
            out[j] = cutlass.Float32(cutlass.select_(valid, raw[j], cutlass.Float32(0.0)))
    return out


@cute.jit
def _store_image_row(record: cute.Pointer, part: cutlass.Constexpr[str], values: cute.Tensor, row, col0):
    """One lane's 8 values of ``row`` as bf16 into the K_INTER image ``part``: 8 consecutive
    columns of one 8-column group are 16 contiguous bytes, one global vector store."""
    words = cute.make_rmem_tensor(cute.make_layout(LANE_COLS // 2), cutlass.Int32)
    for m in cutlass.range_constexpr(LANE_COLS // 2):
        words[m] = pack_bf16x2(values[2 * m], values[2 * m + 1])
    image = cute.recast_ptr(record_part(record, part, cutlass.BFloat16), dtype=cutlass.Int32)
    _vector(image, k_inter_index(row, col0) // 2, LANE_COLS // 2).store(words.load())


@cute.jit
def _row_scan(x, has_source: list):
    """Inclusive prefix sum of ``x`` over the 8 lanes of a column (lanes t, t + 4, …, t + 28).
    ``has_source[b]`` is 1.0 where lane ≥ 4·2^b (the shuffle's source exists), else 0.0: one
    FFMA per step instead of a select and an add (the values are finite)."""
    for offset in cutlass.range_constexpr(3):
        below = cute.arch.shuffle_sync_up(x, offset=4 << offset)
        x = below * has_source[offset] + x
    return x


@cute.jit
def _store_row_norms(vq: list, vk: list, s_norm: cute.Tensor, my_rows: tuple, warp):
    """Phase A: the squared norms of the lane's q and k rows over its warp's columns into the
    cross-warp exchange ``s_norm[(which·16 + row)·WARPS + warp]`` (which: 0 q, 1 k)."""
    for which, values in enumerate((vq, vk)):
        for half in cutlass.range_constexpr(2):
            ss = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(LANE_COLS):
                ss = ss + values[half][j] * values[half][j]
            # After the two butterflies the row's four lanes hold the same bits; each
            # stores them (same value, same address).
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1)
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=2)
            s_norm[(which * CHUNK + my_rows[half]) * WARPS + warp] = ss


@cute.jit
def _normalised_and_gates(vq: list, vk: list, vg: list, valid: list, s_norm: cute.Tensor, my_rows: tuple, gate_scale,
                          gate_bias: cute.Tensor, gamma_scale):
    """Phase B: q̂ and k̂ (L2-normalised, rounded to bf16) and γ in log2 units (zero on rows past
    the end) of the lane's elements, lists over its two rows."""
    qhat = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    khat = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    gamma = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    for half in cutlass.range_constexpr(2):
        sums = [_vector(s_norm.iterator, (which * CHUNK + my_rows[half]) * WARPS, WARPS).load() for which in range(2)]
        rq, rk = (cute.math.rsqrt((s[0] + s[1]) + (s[2] + s[3]) + 1e-6) for s in sums)
        for j in cutlass.range_constexpr(LANE_COLS):
            qhat[half][j] = (vq[half][j] * rq).to(cutlass.BFloat16).to(cutlass.Float32)
            khat[half][j] = (vk[half][j] * rk).to(cutlass.BFloat16).to(cutlass.Float32)
            logistic = cute.arch.rcp_approx(
                cutlass.Float32(1.0) + exp2_fast(vg[half][j] * gate_scale + gate_bias[j]))
            gamma[half][j] = cutlass.Float32(cutlass.select_(valid[half], gamma_scale * logistic, cutlass.Float32(0.0)))
    return qhat, khat, gamma


@cute.jit
def _gate_cumsum(gamma: list, has_source: list, lane):
    """G for rows g (a scan over the column's 8 lanes) and g + 8 (the same scan plus the first 8
    rows' total, held by lane 28 + t), and G[15] with 2^G[15] (gt): (cum, total, gtot)."""
    cum = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    total = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    gtot = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    totals_lane = last_row_lane(lane)
    for j in cutlass.range_constexpr(LANE_COLS):
        upper = _row_scan(gamma[0][j], has_source)
        lower = _row_scan(gamma[1][j], has_source)
        upper_total = cute.arch.shuffle_sync(upper, offset=totals_lane)
        lower_total = cute.arch.shuffle_sync(lower, offset=totals_lane)
        cum[0][j] = upper
        cum[1][j] = upper_total + lower
        total[j] = upper_total + lower_total
        gtot[j] = exp2_fast(total[j])
    return cum, total, gtot


@cute.jit
def _store_product_partials(kd_bits: list, qd_bits: list, kinv_bits: list, s_part: cute.Tensor, warp, lane):
    """Phase C: this warp's partials (over its 32 keys) of product f = 2·p + n (p: 0 = kd·kinvᵀ,
    1 = qd·kinvᵀ; n: token n-tile, i.e. B's rows 8n..8n+7 = the lane's row g + 8n) into the
    exchange."""
    partial = [cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32) for _ in range(4)]
    for f in cutlass.range_constexpr(4):
        partial[f].fill(0.0)
    for s in cutlass.range_constexpr(K_STEPS):
        lo, hi = fragment_value(s, 0), fragment_value(s, 1)
        a = [[x[0][lo], x[1][lo], x[0][hi], x[1][hi]] for x in (kd_bits, qd_bits)]
        for n in cutlass.range_constexpr(2):
            b_frag = [kinv_bits[n][lo], kinv_bits[n][hi]]
            for p in cutlass.range_constexpr(2):
                acc = partial[2 * p + n]
                d = mma_tf32_m16n8k8(a[p], b_frag, [acc[c] for c in range(4)])
                for c in cutlass.range_constexpr(4):
                    acc[c] = d[c]
    for f in cutlass.range_constexpr(4):
        _vector(s_part.iterator, ((warp * 4 + f) * 32 + lane) * 4, 4).store(partial[f].load())


@cute.jit
def _summed_partials(s_part: cute.Tensor, f: int, lane) -> list:
    """Product ``f``'s C fragment summed over the four warps' partials, in a fixed order."""
    parts = [_vector(s_part.iterator, ((src * 4 + f) * 32 + lane) * 4, 4).load() for src in range(WARPS)]
    return [(parts[0][c] + parts[1][c]) + (parts[2][c] + parts[3][c]) for c in range(4)]


@cute.jit
def _reduce_mqk(s_part: cute.Tensor, mqk: cute.Pointer, half_n, lane):
    """Phase C, after the exchange: n-tile ``half_n`` of Mqk (lower incl.) as bf16 into ``mqk``."""
    acc = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
    summed = _summed_partials(s_part, 2 + half_n, lane)
    for c in cutlass.range_constexpr(4):
        i, j = _fragment_entry(lane, half_n, c)
        acc[c] = summed[c] if j <= i else cutlass.Float32(0.0)
    _store_fragment_bf16(mqk, acc, half_n, lane)


@cute.jit
def _reduce_l(s_part: cute.Tensor, b, lane) -> list:
    """Phase C, after the exchange, in one warp whose lane r < 16 holds b = σ(β) of row r:
    L = strict_lower(diag(b)·kd·kinvᵀ) as C fragments ([n-tile][value], fp32)."""
    g = lane // 4
    b_row = [cute.arch.shuffle_sync(b, offset=g + 8 * h) for h in range(2)]
    l_frags = []
    for n in cutlass.range_constexpr(2):
        summed = _summed_partials(s_part, n, lane)
        tile = []
        for c in cutlass.range_constexpr(4):
            i, j = _fragment_entry(lane, n, c)
            tile.append(cutlass.Float32(cutlass.select_(j < i, b_row[c // 2] * summed[c], cutlass.Float32(0.0))))
        l_frags.append(tile)
    return l_frags


def _f16_blocks(m: list) -> list:
    """A 16 × 16 matrix's C fragments (two n-tiles) as fp16 pairs, its four 8 × 8 blocks in the
    m16n8k16 A order: (rows 0–7, cols 0–7), (8–15, 0–7), (0–7, 8–15), (8–15, 8–15)."""
    return [pack_f16x2(m[n][2 * h], m[n][2 * h + 1]) for n in range(2) for h in range(2)]


def _b_operand(blocks: list) -> list:
    """B operands of both n-tiles of a product with the matrix of ``blocks`` on the right: B's
    fragment of n-tile n is Bᵀ's rows 8n..8n+7, i.e. blocks (0, n) and (1, n) transposed."""
    t = [movmatrix_trans(x) for x in blocks]
    return [[t[2 * n], t[2 * n + 1]] for n in range(2)]


def _f16_product(a_blocks: list, b_operand: list, init=None) -> list:
    """C fragments of A·B (+ ``init``), 16 × 16, one m16n8k16 per n-tile."""
    return [mma_f16_m16n8k16(a_blocks, b_operand[n], init[n] if init is not None else [cutlass.Float32(0.0)] * 4)
            for n in range(2)]


@cute.jit
def _register_inverse(l_frags: list, lane) -> list:
    """Phase D in one warp's registers: INV = (I − L)(I + L²)(I + L⁴)(I + L⁸) as C fragments from
    L's (``_reduce_l``).  The m16n8k16 C layout of two n-tiles is its A layout, and B's fragments
    are the transposed 8 × 8 blocks (``movmatrix``), so no value leaves the warp: no barrier.
    fp16 operands (tf32's 11-bit significand; |L| ≤ 1 bounds every power and partial product of
    a 16 × 16 unit triangular inverse by 2^15 < 65504), fp32 sums, P kept in fp32."""
    p = []
    for n in cutlass.range_constexpr(2):
        tile = []
        for c in cutlass.range_constexpr(4):
            i, j = _fragment_entry(lane, n, c)
            tile.append((cutlass.Float32(1.0) if i == j else cutlass.Float32(0.0)) - l_frags[n][c])
        p.append(tile)
    return _neumann_products(p, l_frags)


def _neumann_products(p: list, l_frags: list) -> list:
    """P·(I + L²)(I + L⁴)(I + L⁸) from the C fragments of P (P = I − L gives INV) and L."""
    l_blocks = _f16_blocks(l_frags)
    x = _f16_product(l_blocks, _b_operand(l_blocks))  # X = L²
    for step in range(3):
        x_blocks = _f16_blocks(x)
        x_operand = _b_operand(x_blocks)
        p_next = _f16_product(_f16_blocks(p), x_operand, init=p)  # P ← P + P·X
        if step < 2:
            x = _f16_product(x_blocks, x_operand)  # X ← X², beside P's product
        p = p_next
    return p


@cute.jit
def _store_inverse(inv: cute.Pointer, p: list, lane):
    """INV's C fragments as the bf16 row-major 16 × 16 ``inv``."""
    for n in cutlass.range_constexpr(2):
        acc = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
        for c in cutlass.range_constexpr(4):
            acc[c] = p[n][c]
        _store_fragment_bf16(inv, acc, n, lane)


@cute.jit
def _next_tile(cu_seqlens: cute.Pointer, num_seqs, seq_len, slot, seq, base, next_base,
               varlen: cutlass.Constexpr[bool]):
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


def _input_tile(inputs: cute.Pointer, buffer, which: int) -> cute.Pointer:
    """Start of input tile ``which`` (0 q, 1 k, 2 g) of load buffer ``buffer`` (0 or 1, dynamic)."""
    return inputs + cute.assume((buffer * 3 + which) * (CHUNK * D), divby=CHUNK * D)


@cute.jit
def _publish_tile(s_info: cute.Tensor, barriers: cute.Pointer, buffer, token0, rows, lane):
    """Producer lane 0: the tile's (first token, valid rows) into ``s_info[buffer]``, then arm the
    buffer's barrier for its loads (the arrive releases s_info to the threads that wait on it)."""
    if lane == 0:
        s_info[2 * buffer] = token0
        s_info[2 * buffer + 1] = rows
        cute.arch.mbarrier_arrive_and_expect_tx(barriers + buffer, 3 * IMAGE_BYTES)


def _copy_tiles(atoms: tuple, token_coords: cute.Tensor, inputs: cute.Tensor, buffer, barrier, token0, head):
    """Warp 0 (each TMA copy elects a lane): the q, k, g tiles of rows [token0, token0 + 16) of
    ``head`` into load buffer ``buffer``, completing on ``barrier`` (armed beforehand)."""
    origin = (cutlass.Int32(token0), 0, head * INPUT_BLOCKS)
    g_tile = cute.local_tile(cute.domain_offset(origin, token_coords), input_tile_layout().shape, (0, 0, 0))
    for which, atom in enumerate(atoms):
        s_tile = cute.make_tensor(_input_tile(inputs.iterator, buffer, which), input_tile_layout())
        t_smem, t_gmem = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 3),
                                               cute.group_modes(g_tile, 0, 3))
        cute.copy(atom, t_gmem, t_smem, tma_bar_ptr=barrier)


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
    tiles_per_cta: cutlass.Int32,
    scale: cutlass.Float32,
    lower_bound: cutlass.Float32,
    token_coords: cute.Tensor,
    heads: cutlass.Constexpr[int],
    varlen: cutlass.Constexpr[bool],
):
    tid, _, _ = cute.arch.thread_idx()
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
        if cutlass.const_expr(varlen):
            cu = cute.make_tensor(cu_seqlens, cute.make_layout(num_seqs + 1))
            seq = varlen_slot_sequence(cu_seqlens, num_seqs, first_slot, seq_len)
            base = slot_base(cu, seq, seq_len)
            next_base = slot_base(cu, seq + 1, seq_len)
        for b in cutlass.range_constexpr(2):
            if b < count:
                token0, rows, seq, base, next_base = _next_tile(
                    cu_seqlens, num_seqs, seq_len, first_slot + b, seq, base, next_base, varlen)
                _publish_tile(s_info, load_barriers, b, token0, rows, lane)
                _copy_tiles(atoms, token_coords, s_inputs, b, load_barriers + b, token0, head)

    col0 = lane_columns(warp, lane)
    my_rows = lane_rows(lane)
    # σ(e^A_log·(g + dt_bias)) = 1 / (1 + 2^(g·c + dt_bias·c)), c = −e^A_log·log2 e: one FFMA
    # and two MUFU ops per element; γ is kept in log2 units, so every decay is one ex2.
    gate_scale = -cute.math.exp(cute.make_tensor(a_log, cute.make_layout(heads))[head]) * cutlass.Float32(LOG2E)
    bias = _vector(dt_bias, head * D + col0, LANE_COLS).load()
    gate_bias = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    for j in cutlass.range_constexpr(LANE_COLS):
        gate_bias[j] = bias[j] * gate_scale
    gamma_scale = lower_bound * cutlass.Float32(LOG2E)
    has_source = [cutlass.Float32(cutlass.select_(lane >= 4 << b, cutlass.Float32(1.0), cutlass.Float32(0.0)))
                  for b in range(3)]
    for i in range(count):
        slot = first_slot + i
        buffer = i % 2
        slot_index = cutlass.Int64(head) * cutlass.Int64(total_slots) + cutlass.Int64(slot)
        record = workspace + cute.assume(slot_index * WORKSPACE_RECORD_BYTES, divby=16)
        cute.arch.mbarrier_wait(load_barriers + buffer, (i // 2) % 2)
        token0 = s_info[2 * buffer]
        rows = s_info[2 * buffer + 1]

        # ---- phase A: the lane's fragments, row norms (shuffles + a cross-warp exchange) ------
        valid = [r < rows for r in my_rows]
        # g needs no mask: γ itself is zeroed on rows past the end.
        vq, vk, vg = ([_lane_row_values(_input_tile(s_inputs.iterator, buffer, which), r, col0, ok if which < 2 else True)
                       for r, ok in zip(my_rows, valid)] for which in range(3))
        _store_row_norms(vq, vk, s_norm, my_rows, warp)
        # β logits of rows tid < 16: loaded here, used only at the end of phase C, so their
        # global latency overlaps phases A-C instead of holding the next barrier.
        logit = cutlass.Float32(-float("inf"))
        if tid < rows:
            if tid < CHUNK:
                # A one-element view at the element itself: a size-1 layout has stride 0.
                beta_at = beta + (cutlass.Int64(token0) + tid) * cutlass.Int64(beta_row_stride) + cutlass.Int64(head)
                logit = cute.make_tensor(beta_at, cute.make_layout(1))[0].to(cutlass.Float32)
        cute.arch.sync_threads()
        # Every thread has read this buffer and its s_info: refill both with tile i + 2.
        if cute.arch.warp_idx() == 0:
            if i + 2 < count:
                next_token0, next_rows, seq, base, next_base = _next_tile(
                    cu_seqlens, num_seqs, seq_len, slot + 2, seq, base, next_base, varlen)
                _publish_tile(s_info, load_barriers, buffer, next_token0, next_rows, lane)
                _copy_tiles(atoms, token_coords, s_inputs, buffer, load_barriers + buffer, next_token0, head)

        if rows > 0:
            # ---- phase B: q̂, k̂, γ (log2 units), the cumsum G over rows and the decayed operands --
            qhat, khat, gamma = _normalised_and_gates(vq, vk, vg, valid, s_norm, my_rows, gate_scale, gate_bias,
                                                      gamma_scale)
            cum, total, gtot = _gate_cumsum(gamma, has_source, lane)
            if lane < 4:
                _vector(record_part(record, "gt", cutlass.Float32), col0, LANE_COLS).store(gtot.load())

            # The bf16 images go to the workspaces; L and Mqk use the fp32 values as tf32 operands,
            # so they do not inherit the images' rounding (with cancellation in q̂·k̂ that rounding
            # can dominate a 16×16 entry).
            kd_bits = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Int32) for _ in range(2)]
            qd_bits = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Int32) for _ in range(2)]
            kinv_bits = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Int32) for _ in range(2)]
            for half in cutlass.range_constexpr(2):
                qd = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
                kd = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
                kr = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
                for j in cutlass.range_constexpr(LANE_COLS):
                    g_row = cum[half][j]
                    decay = exp2_fast(g_row)
                    qd[j] = qhat[half][j] * decay * scale
                    kd[j] = khat[half][j] * decay
                    kr[j] = khat[half][j] * exp2_fast(total[j] - g_row)
                    qd_bits[half][j] = f32_bits(tf32_ready(qd[j]))
                    kd_bits[half][j] = f32_bits(tf32_ready(kd[j]))
                    kinv_bits[half][j] = f32_bits(tf32_ready(khat[half][j] * exp2_fast(-g_row)))
                for part, values in (("qd", qd), ("kd", kd), ("kr", kr)):
                    _store_image_row(record, part, values, my_rows[half], col0)

            # ---- phase C: L and Mqk, split over keys by warp ------------------------------------
            _store_product_partials(kd_bits, qd_bits, kinv_bits, s_part, warp, lane)
            b = cutlass.Float32(0.0)
            if warp == 0:
                b = sigmoid(logit)
                if lane < CHUNK:
                    cute.make_tensor(record_part(record, "b", cutlass.Float32), cute.make_layout(CHUNK))[lane] = b
            cute.arch.sync_threads()

            # ---- phase D: INV = (I - L)(I + L²)(I + L⁴)(I + L⁸) in warp 0's registers -----------
            # (it sums L's partials first); warps 2-3 sum Mqk's meanwhile.  No barrier: the next
            # tile's exchange is written after its phase A barrier, which warp 0 reaches last.
            if warp == 0:
                _store_inverse(record_part(record, "inv", cutlass.BFloat16), _register_inverse(_reduce_l(s_part, b, lane),
                                                                                              lane), lane)
            elif warp >= 2:
                _reduce_mqk(s_part, record_part(record, "mqk", cutlass.BFloat16), warp % 2, lane)


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
    tiles_per_cta: cutlass.Int32,
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
        seq_len, num_seqs, total_slots, beta_row_stride, tiles_per_cta, scale, lower_bound, token_coords, heads,
        varlen,
    ).launch(grid=[(total_slots + tiles_per_cta - 1) // tiles_per_cta, heads, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, stream=stream,
             # Caps registers at 128 (ptxas .minnctapersm); the carveout is given so that tracing
             # does not ask a GPU for the SM's shared memory (the runtime sets it on load).
             min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=100)
