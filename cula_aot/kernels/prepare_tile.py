"""K1's work on one 16×128 tile of one head, shared by K1 (``k1_prepare.py``) and the fused prefill's
producers (``fused_prefill.py``): the TMA copies of the q, k, g tiles, the lane fragment maps, phase A
(row norms), phase B (q̂, k̂, γ and its cumsum), phase C (the L and Mqk partial products and their
fixed-order sums) and phase D (the 16×16 inverse in one warp's registers).  See ``k1_prepare``'s
docstring for the layouts."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .common import (
    CHUNK,
    D,
    THREADS,
    TRACE_HEADS,
    exp2_fast,
    INPUT_BLOCKS,
    input_tile_layout,
    input_element_offset,
    make_token_tma,
    vector,
)
from .gate import UNBOUNDED_GAMMA_FLOOR, Gate
from .params import grouped
from .warp_mma import f32_bits, mma_f16_m16n8k16, mma_tf32_m16n8k8, movmatrix_trans, pack_bf16x2, pack_f16x2, tf32_ready

WARPS = THREADS // 32
# The fragment layout: a warp's key columns, and the consecutive columns of one lane's row.
WARP_COLS = D // WARPS
LANE_COLS = 8
K_STEPS = WARP_COLS // 8  # m16n8k8 k-steps over a warp's columns


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


def fragment_entry(lane, n_tile, c: int):
    """(row, column) of value ``c`` of this lane's 16×8 C fragment of n-tile ``n_tile``."""
    return lane // 4 + 8 * (c // 2), n_tile * 8 + 2 * (lane % 4) + c % 2


def store_fragment_bf16(matrix: cute.Pointer, acc: cute.Tensor, n_tile, lane):
    """This lane's C fragment of n-tile ``n_tile`` into a row-major bf16 16×16 global matrix:
    values 2h, 2h + 1 are adjacent columns, so each pair is one 4-byte store."""
    words = cute.make_tensor(cute.recast_ptr(matrix, dtype=cutlass.Int32), cute.make_layout(CHUNK * CHUNK // 2))
    for pair in range(2):
        i, j = fragment_entry(lane, n_tile, 2 * pair)
        words[(i * CHUNK + j) // 2] = pack_bf16x2(acc[2 * pair], acc[2 * pair + 1])


@cute.jit
def lane_row_values(tile: cute.Pointer, row, col0, valid):
    """The 8 bf16 elements of input tile ``tile`` at (row, col0 .. col0 + 7) as fp32 (one 16-byte
    shared read), zeros if not ``valid`` (``True``: no mask)."""
    raw = vector(tile, input_element_offset(row, col0), LANE_COLS).load().to(cutlass.Float32)
    out = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    for j in cutlass.range_constexpr(LANE_COLS):
        if cutlass.const_expr(valid is True):
            out[j] = raw[j]
        else:
            out[j] = cutlass.Float32(cutlass.select_(valid, raw[j], cutlass.Float32(0.0)))
    return out


@cute.jit
def row_scan(x, has_source: list):
    """Inclusive prefix sum of ``x`` over the 8 lanes of a column (lanes t, t + 4, …, t + 28).
    ``has_source[b]`` is 1.0 where lane ≥ 4·2^b (the shuffle's source exists), else 0.0: one
    FFMA per step instead of a select and an add (the values are finite)."""
    for offset in cutlass.range_constexpr(3):
        below = cute.arch.shuffle_sync_up(x, offset=4 << offset)
        x = below * has_source[offset] + x
    return x


@cute.jit
def store_row_norms(vq: list, vk: list, s_norm: cute.Tensor, my_rows: tuple, warp):
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


def load_fragments(inputs: cute.Pointer, buffer, my_rows: tuple, col0, rows, s_norm: cute.Tensor, warp):
    """Phase A: (valid, q, k, g) — which of the lane's rows hold tokens and its fragments of load
    buffer ``buffer`` (q and k zeroed past ``rows``; g needs no mask: γ itself is zeroed there),
    the q and k row norms stored into ``s_norm`` (``store_row_norms``)."""
    valid = [r < rows for r in my_rows]
    vq, vk, vg = (
        [
            lane_row_values(input_tile(inputs, buffer, which), r, col0, ok if which < 2 else True)
            for r, ok in zip(my_rows, valid)
        ]
        for which in range(3)
    )
    store_row_norms(vq, vk, s_norm, my_rows, warp)
    return valid, vq, vk, vg


def gate_constants(a_log: cute.Pointer, dt_bias: cute.Pointer, head, col0, lower_bound, lane, gate: Gate):
    """Phase B's per-CTA constants for the lane's columns, as (gate_scale, gate_bias per column,
    gamma_scale, ``row_scan``'s has_source factors): the gate's (``Gate.tile_constants``; γ in
    log2 units, so every decay is one ex2) and the scan's."""
    gate_scale, gate_bias, gamma_scale = gate.tile_constants(a_log, dt_bias, head, col0, lower_bound, LANE_COLS)
    has_source = [
        cutlass.Float32(cutlass.select_(lane >= 4 << b, cutlass.Float32(1.0), cutlass.Float32(0.0))) for b in range(3)
    ]
    return gate_scale, gate_bias, gamma_scale, has_source


@cute.jit
def normalised_and_gates(
    vq: list,
    vk: list,
    vg: list,
    valid: list,
    s_norm: cute.Tensor,
    my_rows: tuple,
    gate_scale,
    gate_bias: cute.Tensor,
    gamma_scale,
    gate: cutlass.Constexpr[str],  # a Gate
    qk_as_given=None,
):
    """Phase B: q̂ and k̂ (L2-normalised, or as given where the runtime flag ``qk_as_given`` is set;
    None: always normalised, no select; rounded to bf16) and γ in log2 units (zero on rows past
    the end) of the lane's elements, lists over its two rows (``gate_constants`` for the gate)."""
    qhat = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    khat = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    gamma = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    for half in cutlass.range_constexpr(2):
        sums = [vector(s_norm.iterator, (which * CHUNK + my_rows[half]) * WARPS, WARPS).load() for which in range(2)]
        rq, rk = (cute.math.rsqrt((s[0] + s[1]) + (s[2] + s[3]) + 1e-6) for s in sums)
        if cutlass.const_expr(qk_as_given is not None):
            rq, rk = (cutlass.Float32(cutlass.select_(qk_as_given, cutlass.Float32(1.0), r)) for r in (rq, rk))
        for j in cutlass.range_constexpr(LANE_COLS):
            qhat[half][j] = (vq[half][j] * rq).to(cutlass.BFloat16).to(cutlass.Float32)
            khat[half][j] = (vk[half][j] * rk).to(cutlass.BFloat16).to(cutlass.Float32)
            decay = gate.tile_gamma(vg[half][j], gate_scale, gate_bias, j, gamma_scale)
            gamma[half][j] = cutlass.Float32(cutlass.select_(valid[half], decay, cutlass.Float32(0.0)))
    return qhat, khat, gamma


@cute.jit
def gate_cumsum(gamma: list, has_source: list, lane):
    """G for rows g (a scan over the column's 8 lanes) and g + 8 (the same scan plus the first 8
    rows' total, held by lane 28 + t), G[15] with 2^G[15] (gt): (cum, total, gtot)."""
    cum = [cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32) for _ in range(2)]
    total = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    gtot = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    totals_lane = last_row_lane(lane)
    for j in cutlass.range_constexpr(LANE_COLS):
        upper = row_scan(gamma[0][j], has_source)
        lower = row_scan(gamma[1][j], has_source)
        upper_total = cute.arch.shuffle_sync(upper, offset=totals_lane)
        lower_total = cute.arch.shuffle_sync(lower, offset=totals_lane)
        cum[0][j] = upper
        cum[1][j] = upper_total + lower
        total[j] = upper_total + lower_total
        gtot[j] = exp2_fast(total[j])
    return cum, total, gtot


def decayed_operands(
    qhat: list,
    khat: list,
    cum: list,
    scale,
    total: cute.Tensor,
    gtot: cute.Tensor,
    store_images,
    kr_from_kinv: bool = False,
):
    """Phase B's decayed operands of the lane's two rows: qd = q̂·2^G·scale, kd = k̂·2^G and
    kr = k̂·2^(G[15] − G), handed row by row to ``store_images(half, qd, kd, kr)``; returns the
    tf32 bits of kd, qd and kinv = k̂·2^−G (phase C's A and B operands: rounded from the fp32
    values, not from the bf16 images, whose rounding can dominate an entry where q̂·k̂ cancels).
    kr by its own MUFU op from G[15] (``total``), or with ``kr_from_kinv`` as kinv·2^G[15]
    (``gtot``: one MUFU op fewer, both factors normal while G ≥ −116)."""
    bits = [[cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Int32) for _ in range(2)] for _ in range(3)]
    kd_bits, qd_bits, kinv_bits = bits
    for half in range(2):
        qd = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
        kd = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
        kr = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
        for j in range(LANE_COLS):
            g_row = cum[half][j]
            decay = exp2_fast(g_row)
            qd[j] = qhat[half][j] * decay * scale
            kd[j] = khat[half][j] * decay
            kinv = khat[half][j] * exp2_fast(-g_row)
            if kr_from_kinv:
                kr[j] = kinv * gtot[j]
            else:
                kr[j] = khat[half][j] * exp2_fast(total[j] - g_row)
            qd_bits[half][j] = f32_bits(tf32_ready(qd[j]))
            kd_bits[half][j] = f32_bits(tf32_ready(kd[j]))
            kinv_bits[half][j] = f32_bits(tf32_ready(kinv))
        store_images(half, qd, kd, kr)
    return kd_bits, qd_bits, kinv_bits


def decayed_partials(
    qhat: list,
    khat: list,
    cum: list,
    total: cute.Tensor,
    gtot: cute.Tensor,
    scale,
    store_images,
    s_part: cute.Tensor,
    warp,
    lane,
    gate: Gate,
    kr_from_kinv: bool = False,
):
    """Phases B and C after the cumsum, by ``gate``: the decayed images to ``store_images`` and
    the warp's partial products into the exchange (the safe gate: ``decayed_operands``, kr as
    ``kr_from_kinv`` says, then ``store_product_partials``; the unbounded ones:
    ``unbounded_operands``)."""
    if gate.bounded:
        kd_bits, qd_bits, kinv_bits = decayed_operands(qhat, khat, cum, scale, total, gtot, store_images, kr_from_kinv)
        store_product_partials(kd_bits, qd_bits, kinv_bits, s_part, warp, lane)
    else:
        unbounded_operands(qhat, khat, cum, total, scale, store_images, s_part, warp, lane)


@cute.jit
def store_product_partials(kd_bits: list, qd_bits: list, kinv_bits: list, s_part: cute.Tensor, warp, lane):
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
        vector(s_part.iterator, ((warp * 4 + f) * 32 + lane) * 4, 4).store(partial[f].load())


# Unbounded gates (softplus, precomputed): 2^(G_i − G_j) of a pair j ≤ i of a tile is formed as
# 2^(G_i − P)·2^(P − G_j) around P = G[15]/2, the midpoint of the tile's span [G[15], 0].  A span
# of at most BLOCK_RANGE (log2 units) keeps both factors ≤ 2^(BLOCK_RANGE / 2) and c = 2^(G[15]/2)
# ≥ 2^(−BLOCK_RANGE / 2) normal, so no factor overflows or flushes.  The gate's per-token floor
# bounds every tile's span, in every column, by 16·14 = 224: no warp needs another form.
BLOCK_RANGE = 224.0
assert CHUNK * -UNBOUNDED_GAMMA_FLOOR <= BLOCK_RANGE
# Unit-norm rows' operands, k̂·2^(±BLOCK_RANGE/2) and q̂·scale·2^(−BLOCK_RANGE/2) (components down
# to ~2^-7 typical), then stay above fp32's smallest normal, 2^-126.
assert BLOCK_RANGE / 2 + 7 < 126


@cute.jit
def unbounded_operands(
    qhat: list, khat: list, cum: list, total: cute.Tensor, scale, store_images, s_part: cute.Tensor, warp, lane
):
    """Phases B and C of an unbounded gate: the decayed images, handed row by row to
    ``store_images(half, qd, kd, kr)`` (qd = q̂·2^G·scale, kd = k̂·2^G, kr = k̂·2^(G[15] − G)), and
    this warp's partials of kd·kinvᵀ and qd·kinvᵀ around P = G[15]/2 (``BLOCK_RANGE``).  With
    c = 2^(G[15]/2) one pair of exponentials per element serves images and products alike (the
    safe gate's MUFU count): 2^G = 2^(G − P)·c, 2^(G[15] − G) = 2^(P − G)·c."""
    c = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
    for j in cutlass.range_constexpr(LANE_COLS):
        c[j] = exp2_fast(total[j] * 0.5)
    bits = [[cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Int32) for _ in range(2)] for _ in range(3)]
    kd_bits, qd_bits, kinv_bits = bits
    for half in cutlass.range_constexpr(2):
        qd = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
        kd = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
        kr = cute.make_rmem_tensor(cute.make_layout(LANE_COLS), cutlass.Float32)
        for j in cutlass.range_constexpr(LANE_COLS):
            rise = exp2_fast(cum[half][j] - total[j] * 0.5)
            fall = exp2_fast(total[j] * 0.5 - cum[half][j])
            q_rise = qhat[half][j] * rise * scale
            k_rise = khat[half][j] * rise
            k_fall = khat[half][j] * fall
            qd[j] = q_rise * c[j]
            kd[j] = k_rise * c[j]
            kr[j] = k_fall * c[j]
            kd_bits[half][j] = f32_bits(tf32_ready(k_rise))
            qd_bits[half][j] = f32_bits(tf32_ready(q_rise))
            kinv_bits[half][j] = f32_bits(tf32_ready(k_fall))
        store_images(half, qd, kd, kr)
    store_product_partials(kd_bits, qd_bits, kinv_bits, s_part, warp, lane)


@cute.jit
def summed_partials(s_part: cute.Tensor, f: int, lane) -> list:
    """Product ``f``'s C fragment summed over the four warps' partials, in a fixed order."""
    parts = [vector(s_part.iterator, ((src * 4 + f) * 32 + lane) * 4, 4).load() for src in range(WARPS)]
    return [(parts[0][c] + parts[1][c]) + (parts[2][c] + parts[3][c]) for c in range(4)]


@cute.jit
def reduce_mqk(s_part: cute.Tensor, mqk: cute.Pointer, half_n, lane):
    """Phase C, after the exchange: n-tile ``half_n`` of Mqk (lower incl.) as bf16 into ``mqk``."""
    acc = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
    summed = summed_partials(s_part, 2 + half_n, lane)
    for c in cutlass.range_constexpr(4):
        i, j = fragment_entry(lane, half_n, c)
        acc[c] = summed[c] if j <= i else cutlass.Float32(0.0)
    store_fragment_bf16(mqk, acc, half_n, lane)


@cute.jit
def reduce_l(s_part: cute.Tensor, b, lane) -> list:
    """Phase C, after the exchange, in one warp whose lane r < 16 holds b = σ(β) of row r:
    L = strict_lower(diag(b)·kd·kinvᵀ) as C fragments ([n-tile][value], fp32)."""
    g = lane // 4
    b_row = [cute.arch.shuffle_sync(b, offset=g + 8 * h) for h in range(2)]
    l_frags = []
    for n in cutlass.range_constexpr(2):
        summed = summed_partials(s_part, n, lane)
        tile = []
        for c in cutlass.range_constexpr(4):
            i, j = fragment_entry(lane, n, c)
            tile.append(cutlass.Float32(cutlass.select_(j < i, b_row[c // 2] * summed[c], cutlass.Float32(0.0))))
        l_frags.append(tile)
    return l_frags


def f16_blocks(m: list) -> list:
    """A 16 × 16 matrix's C fragments (two n-tiles) as fp16 pairs, its four 8 × 8 blocks in the
    m16n8k16 A order: (rows 0–7, cols 0–7), (8–15, 0–7), (0–7, 8–15), (8–15, 8–15)."""
    return [pack_f16x2(m[n][2 * h], m[n][2 * h + 1]) for n in range(2) for h in range(2)]


def b_operand(blocks: list) -> list:
    """B operands of both n-tiles of a product with the matrix of ``blocks`` on the right: B's
    fragment of n-tile n is Bᵀ's rows 8n..8n+7, i.e. blocks (0, n) and (1, n) transposed."""
    t = [movmatrix_trans(x) for x in blocks]
    return [[t[2 * n], t[2 * n + 1]] for n in range(2)]


def f16_product(a_blocks: list, b_operand: list, init=None) -> list:
    """C fragments of A·B (+ ``init``), 16 × 16, one m16n8k16 per n-tile."""
    return [
        mma_f16_m16n8k16(a_blocks, b_operand[n], init[n] if init is not None else [cutlass.Float32(0.0)] * 4)
        for n in range(2)
    ]


@cute.jit
def register_inverse(l_frags: list, lane) -> list:
    """Phase D in one warp's registers: INV = (I − L)(I + L²)(I + L⁴)(I + L⁸) as C fragments from
    L's (``reduce_l``).  The m16n8k16 C layout of two n-tiles is its A layout, and B's fragments
    are the transposed 8 × 8 blocks (``movmatrix``), so no value leaves the warp: no barrier.
    fp16 operands (tf32's 11-bit significand; |L| ≤ 1 bounds every power and partial product of
    a 16 × 16 unit triangular inverse by 2^15 < 65504), fp32 sums, P kept in fp32."""
    p = []
    for n in cutlass.range_constexpr(2):
        tile = []
        for c in cutlass.range_constexpr(4):
            i, j = fragment_entry(lane, n, c)
            tile.append((cutlass.Float32(1.0) if i == j else cutlass.Float32(0.0)) - l_frags[n][c])
        p.append(tile)
    return neumann_products(p, l_frags)


def neumann_products(p: list, l_frags: list) -> list:
    """P·(I + L²)(I + L⁴)(I + L⁸) from the C fragments of P (P = I − L gives INV) and L."""
    l_blocks = f16_blocks(l_frags)
    x = f16_product(l_blocks, b_operand(l_blocks))  # X = L²
    for step in range(3):
        x_blocks = f16_blocks(x)
        x_operand = b_operand(x_blocks)
        p_next = f16_product(f16_blocks(p), x_operand, init=p)  # P ← P + P·X
        if step < 2:
            x = f16_product(x_blocks, x_operand)  # X ← X², beside P's product
        p = p_next
    return p


@cute.jit
def store_inverse(inv: cute.Pointer, p: list, lane):
    """INV's C fragments as the bf16 row-major 16 × 16 ``inv``."""
    for n in cutlass.range_constexpr(2):
        acc = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
        for c in cutlass.range_constexpr(4):
            acc[c] = p[n][c]
        store_fragment_bf16(inv, acc, n, lane)


@cute.jit
def reduce_and_invert(part, s_part: cute.Tensor, b, warp, inverse_warp, lane):
    """Phase D: warp ``inverse_warp`` sums L's partials and stores INV = (I + L)⁻¹ from its
    registers, warps 2–3 sum Mqk's meanwhile; ``part(name, dtype)`` points at the record's part."""
    if warp == inverse_warp:
        store_inverse(part("inv", cutlass.BFloat16), register_inverse(reduce_l(s_part, b, lane), lane), lane)
    elif warp >= 2:
        reduce_mqk(s_part, part("mqk", cutlass.BFloat16), warp % 2, lane)


def input_tile(inputs: cute.Pointer, buffer, which: int) -> cute.Pointer:
    """Start of input tile ``which`` (0 q, 1 k, 2 g) of load buffer ``buffer`` (0 or 1, dynamic)."""
    return inputs + cute.assume((buffer * 3 + which) * (CHUNK * D), divby=CHUNK * D)


def copy_tiles(atoms: tuple, token_coords: cute.Tensor, inputs: cute.Tensor, buffer, barrier, token0, head):
    """Warp 0 (each TMA copy elects a lane): the q, k, g tiles of rows [token0, token0 + 16) of
    ``head`` into load buffer ``buffer``, completing on ``barrier`` (armed beforehand)."""
    origin = (cutlass.Int32(token0), 0, head * INPUT_BLOCKS)
    g_tile = cute.local_tile(cute.domain_offset(origin, token_coords), input_tile_layout().shape, (0, 0, 0))
    for which, atom in enumerate(atoms):
        s_tile = cute.make_tensor(input_tile(inputs.iterator, buffer, which), input_tile_layout())
        t_smem, t_gmem = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 3), cute.group_modes(g_tile, 0, 3)
        )
        cute.copy(atom, t_gmem, t_smem, tma_bar_ptr=barrier)


class TokenTileKernel:
    """The launch K1 and the fused prefill share: both read q, k and g as 16-token tiles through
    TMA.  ``__call__`` builds the three descriptors from the q, k, g pointers and passes them
    ahead of the kernel's runtime parameters (``*params``, the spec's list after the
    descriptors), the token coordinates after them.  The descriptors and grid built here only
    fix the kernel's types: the runtime encodes the real descriptors per call from the manifest
    recipe and launches the spec's grid.  A subclass gives ``threads``, ``smem_bytes`` and
    ``min_blocks_per_mp``, and its device method as ``kernel``, defined under the former
    function's name less ``_kernel``: with ``str(self)`` ``"kernel"`` the entry symbol stays
    ``kernel_cutlass_<name>_kernel_<the parameters' types>_0``."""

    def __str__(self) -> str:
        return "kernel"  # the entry symbol's component for ``self``

    @cute.jit
    def __call__(self, q: cute.Pointer, k: cute.Pointer, g: cute.Pointer, *params, stream):
        tma_q, token_coords = make_token_tma(q)
        tma_k, _ = make_token_tma(k)
        tma_g, _ = make_token_tma(g)
        # The carveout is given so that tracing does not ask a GPU for the SM's shared memory
        # (the runtime sets it on load).
        self.kernel(*grouped(self.kernel, tma_q, tma_k, tma_g, *params), token_coords).launch(
            grid=[1, TRACE_HEADS, 1],
            block=[self.threads, 1, 1],
            smem=self.smem_bytes,
            stream=stream,
            min_blocks_per_mp=self.min_blocks_per_mp,
            preferred_smem_carveout=100,
        )
