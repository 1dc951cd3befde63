"""Phase C under an unbounded gate (``prepare_tile.unbounded_operands``) emulated per lane on the
CPU: at every depth a warp can reach — one midpoint product for the whole tile, the two halves
and the pairs across them as stacked block pairs, the binary split levels above smaller blocks,
down to single rows — the four warps' partials sum to exactly the pairwise products
Σ_k a_ik·k̂_jk·2^(G_ik − G_jk) (j < i for L, j ≤ i for Mqk).  Depth 1 is emulated in the kernel's
order of fp32 products, each flushed to 0 below 2^-126 and checked finite; the split levels'
factors are ≤ 1 and the blocks' ≤ 2^(BLOCK_RANGE / 2) however fast the gate decays.  Needs
CuTeDSL (the kernel module imports it)."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import prepare_tile as k1  # noqa: E402
from cula_aot.kernels.gate import UNBOUNDED_GAMMA_FLOOR  # noqa: E402
from cula_aot.layout import CHUNK, D  # noqa: E402
from tests.kernels.test_k1_fragments import LANES, _lane_values, _mma_m16n8k8  # noqa: E402


def _pairwise(a, kn, G, strict):
    decay = np.exp2(np.minimum(G[:, None, :] - G[None, :, :], 0.0))
    product = np.einsum("ik,jk,ijk->ij", a, kn, decay)
    return np.tril(product, -1 if strict else 0)


def _warp_depth(G, warp):
    """The depth the kernel's warp reaches (``prepare_tile.unbounded_operands``, ``blocks_fit``):
    0 when the tile spans ≤ BLOCK_RANGE from 0 (its start) in all its 32 columns, 1 when each
    half does from its start (0, G[7]), else the first split into blocks of 16 >> depth rows that
    each span ≤ BLOCK_RANGE from their first row to their last."""
    cols = slice(32 * warp, 32 * warp + 32)
    if (-G[15, cols]).max() <= k1.BLOCK_RANGE:  # the span from the tile's start, 0, to G[15]
        return 0
    if max((-G[7, cols]).max(), (G[7, cols] - G[15, cols]).max()) <= k1.BLOCK_RANGE:  # halves from their start
        return 1
    for depth in range(2, k1.SPLIT_LEVELS):
        size = 16 >> depth
        spans = [G[b, cols] - G[b + size - 1, cols] for b in range(0, CHUNK, size)]
        if max(span.max() for span in spans) <= k1.BLOCK_RANGE:
            return depth
    return k1.SPLIT_LEVELS


FP32_MIN_NORMAL, FP32_MAX = 2.0**-126, 2.0**128


def _f32(x):
    """An fp32 product as the kernel forms it (flush to zero; the value must stay finite)."""
    assert abs(x) < FP32_MAX, x
    return 0.0 if abs(x) < FP32_MIN_NORMAL else x


def _halves_partials(q_regs, k_regs, cum, mid, total):
    """Depth 1 (``prepare_tile.halves_partials``): three 8×8 blocks of stacked products, the
    result's c0, c1 of block (i half, j half) being L (f = j half) and c2, c3 Mqk (f = 2 + j half)
    at values 2·(i half) and 2·(i half) + 1; the block above the diagonal stays 0."""
    ops = {name: np.zeros((LANES, 2, 8)) for name in ("kd", "qd", "kinv", "cross_k", "cross_q")}
    for lane in range(LANES):
        for j in range(8):
            g7, g15 = mid[lane][j], total[lane][j]
            for half, ref in ((0, g7 * 0.5), (1, (g7 + g15) * 0.5)):
                g, q, k = cum[lane][half][j], q_regs[lane][half][j], k_regs[lane][half][j]
                rise, fall = _f32(np.exp2(g - ref)), _f32(np.exp2(ref - g))
                ops["kd"][lane, half, j], ops["qd"][lane, half, j] = _f32(k * rise), _f32(q * rise)
                ops["kinv"][lane, half, j] = _f32(k * fall)
                across = _f32(np.exp2(g7 - g if half == 0 else g - g7))
                assert across <= 1.0
                ops["cross_k"][lane, half, j], ops["cross_q"][lane, half, j] = _f32(k * across), _f32(q * across)
    partial = np.zeros((4, LANES, 4))
    blocks = ((0, 0, "kd", "qd", "kinv"), (1, 1, "kd", "qd", "kinv"), (1, 0, "cross_k", "cross_q", "cross_k"))
    for i_half, j_half, kd, qd, kinv in blocks:
        acc = np.zeros((LANES, 4))
        for s in range(k1.K_STEPS):
            lo, hi = k1.fragment_value(s, 0), k1.fragment_value(s, 1)
            a_regs = [
                [
                    ops[kd][lane, i_half, lo],
                    ops[qd][lane, i_half, lo],
                    ops[kd][lane, i_half, hi],
                    ops[qd][lane, i_half, hi],
                ]
                for lane in range(LANES)
            ]
            b_regs = [[ops[kinv][lane, j_half, lo], ops[kinv][lane, j_half, hi]] for lane in range(LANES)]
            acc += np.array(_mma_m16n8k8(a_regs, b_regs))
        for p in range(2):
            partial[2 * p + j_half, :, 2 * i_half : 2 * i_half + 2] = acc[:, 2 * p : 2 * p + 2]
    return partial


def _warp_partials(qs, kn, G, warp):
    """One warp's partials as the kernel forms them: [f][lane][c], and the depth it took."""
    partial = np.zeros((4, LANES, 4))
    cum = [_lane_values(G, warp, lane) for lane in range(LANES)]
    q_regs = [_lane_values(qs, warp, lane) for lane in range(LANES)]
    k_regs = [_lane_values(kn, warp, lane) for lane in range(LANES)]
    mid = [[G[7, k1.lane_columns(warp, lane) + j] for j in range(k1.LANE_COLS)] for lane in range(LANES)]
    depth = _warp_depth(G, warp)
    if depth == 1:
        total = [[G[15, k1.lane_columns(warp, lane) + j] for j in range(k1.LANE_COLS)] for lane in range(LANES)]
        return _halves_partials(q_regs, k_regs, cum, mid, total), depth

    def add(kd_bits, qd_bits, kinv_bits, n_tiles, keep):
        for n in range(n_tiles):
            for p, x in enumerate((kd_bits, qd_bits)):
                acc = np.zeros((LANES, 4))
                for s in range(k1.K_STEPS):
                    lo, hi = k1.fragment_value(s, 0), k1.fragment_value(s, 1)
                    a_regs = [[x[lane][0][lo], x[lane][1][lo], x[lane][0][hi], x[lane][1][hi]] for lane in range(LANES)]
                    b_regs = [[kinv_bits[lane][n][lo], kinv_bits[lane][n][hi]] for lane in range(LANES)]
                    acc += np.array(_mma_m16n8k8(a_regs, b_regs))
                for lane in range(LANES):
                    for c in range(4):
                        i, col = k1.fragment_entry(lane, n, c)
                        if keep(i, col):
                            partial[2 * p + n, lane, c] += acc[lane, c]

    for level in range(depth):
        kd_bits, qd_bits, kinv_bits = (np.zeros((LANES, 2, 8)) for _ in range(3))
        for lane in range(LANES):
            g, t = divmod(lane, 4)
            for half in range(2):
                for j in range(8):
                    g_row = cum[lane][half][j]
                    if level == 0:
                        is_i, ref = half == 1, mid[lane][j]
                    else:
                        ref_row, is_i = k1.split_reference_row(level, g)
                        ref = cum[4 * ref_row + t][half][j]  # the shuffle's source lane
                    exponent = g_row - ref if is_i else ref - g_row
                    assert exponent <= 0.0  # split factors ≤ 1 at any rate
                    factor = np.exp2(exponent)
                    if is_i:
                        kd_bits[lane, half, j] = k_regs[lane][half][j] * factor
                        qd_bits[lane, half, j] = q_regs[lane][half][j] * factor
                    else:
                        kinv_bits[lane, half, j] = k_regs[lane][half][j] * factor
        add(
            kd_bits,
            qd_bits,
            kinv_bits,
            2 if level > 0 else 1,
            lambda i, col, level=level: col < i and ((i ^ col) >> (3 - level)) == 1,
        )

    kd_bits, qd_bits, kinv_bits = (np.zeros((LANES, 2, 8)) for _ in range(3))
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        for half in range(2):
            for j in range(8):
                if depth == 0:
                    ref = cum[28 + t][1][j] / 2  # G[15] / 2: the midpoint of [G[15], 0]
                else:
                    first, last = k1.block_end_rows(16 >> depth, g)
                    ref = (cum[4 * first + t][half][j] + cum[4 * last + t][half][j]) / 2
                rise, fall = np.exp2(cum[lane][half][j] - ref), np.exp2(ref - cum[lane][half][j])
                assert max(rise, fall) <= 2.0 ** (k1.BLOCK_RANGE / 2)  # finite in fp32
                kd_bits[lane, half, j] = k_regs[lane][half][j] * rise
                qd_bits[lane, half, j] = q_regs[lane][half][j] * rise
                kinv_bits[lane, half, j] = k_regs[lane][half][j] * fall
    shift = 4 - depth
    add(kd_bits, qd_bits, kinv_bits, 2, lambda i, col: (i >> shift) == (col >> shift))
    return partial, depth


def _assembled(partials, p):
    product = np.zeros((CHUNK, CHUNK))
    for n in range(2):
        total = sum(part[2 * p + n] for part in partials)
        for lane in range(LANES):
            for c in range(4):
                i, j = k1.fragment_entry(lane, n, c)
                product[i, j] = total[lane, c]
    return product


@pytest.mark.parametrize("rate", [0.5, 12.0, 25.0, 40.0, 60.0, 150.0, 700.0])
def test_phase_c_gives_the_pairwise_products_at_every_depth(rate):
    rng = np.random.default_rng(int(rate * 10))
    qs, kn = rng.standard_normal((CHUNK, D)) * 0.1, rng.standard_normal((CHUNK, D)) * 0.1
    # Per-token log2 decays: up to ``rate`` on a random half of the (token, key) entries.
    gamma = -rate * rng.random((CHUNK, D)) * (rng.random((CHUNK, D)) < 0.5) - 1e-3 * rng.random((CHUNK, D))
    G = np.cumsum(np.maximum(gamma, UNBOUNDED_GAMMA_FLOOR), axis=0)
    want_l, want_m = _pairwise(kn, kn, G, strict=True), _pairwise(qs, kn, G, strict=False)
    results = [_warp_partials(qs, kn, G, w) for w in range(k1.WARPS)]
    partials = [r[0] for r in results]
    print(f"rate {rate}: warp depths {[r[1] for r in results]}")
    np.testing.assert_allclose(np.tril(_assembled(partials, 0), -1), want_l, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(np.tril(_assembled(partials, 1)), want_m, rtol=1e-9, atol=1e-13)


def test_every_depth_is_reached():
    depths = set()
    for rate in (0.5, 12.0, 25.0, 60.0, 150.0, 700.0):
        rng = np.random.default_rng(int(rate * 10))
        gamma = -rate * rng.random((CHUNK, D)) * (rng.random((CHUNK, D)) < 0.5)
        G = np.cumsum(np.maximum(gamma, UNBOUNDED_GAMMA_FLOOR), axis=0)
        depths.update(_warp_depth(G, w) for w in range(k1.WARPS))
    assert depths == set(range(k1.SPLIT_LEVELS + 1))


def test_split_levels_cover_every_pair_once():
    seen = np.zeros((CHUNK, CHUNK), int)
    for level in range(k1.SPLIT_LEVELS):
        for i in range(CHUNK):
            for j in range(i):
                if ((i ^ j) >> (3 - level)) == 1:
                    seen[i, j] += 1
                    if level > 0:  # i is the upper side, j the lower, of one block pair
                        ref_i, upper_i = k1.split_reference_row(level, i % 8)
                        ref_j, upper_j = k1.split_reference_row(level, j % 8)
                        assert upper_i and not upper_j and ref_i == ref_j and i // 8 == j // 8
                        assert j <= 8 * (i // 8) + ref_i < i  # the reference row r − 1: j ≤ r − 1 < i
    assert (seen == np.tril(np.ones((CHUNK, CHUNK), int), -1)).all()
