"""Phase C under an unbounded gate (``prepare_tile.unbounded_partials``) emulated per lane on the
CPU: both of its forms — the midpoint form (P = G[7]) and the binary-split levels with their
masks and Mqk's diagonal — give each warp's partials of kd·kinvᵀ and qd·kinvᵀ such that the
four warps' sums are exactly the pairwise products Σ_k a_ik·k̂_jk·2^(G_ik − G_jk) (j < i for L,
j ≤ i for Mqk), and every factor the levels form is ≤ 1 however fast the gate decays.  Needs
CuTeDSL (the kernel module imports it)."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import prepare_tile as k1  # noqa: E402
from cula_aot.kernels.common import UNBOUNDED_GAMMA_FLOOR  # noqa: E402
from cula_aot.layout import CHUNK, D  # noqa: E402
from tests.kernels.test_k1_fragments import LANES, _lane_values, _mma_m16n8k8  # noqa: E402


def _pairwise(a, kn, G, strict):
    decay = np.exp2(np.minimum(G[:, None, :] - G[None, :, :], 0.0))
    product = np.einsum("ik,jk,ijk->ij", a, kn, decay)
    return np.tril(product, -1 if strict else 0)


def _warp_partials_levels(qs, kn, G, warp):
    """The level form of one warp, as the kernel computes it: [f][lane][c]."""
    partial = np.zeros((4, LANES, 4))
    cum = [_lane_values(G, warp, lane) for lane in range(LANES)]
    q_regs = [_lane_values(qs, warp, lane) for lane in range(LANES)]
    k_regs = [_lane_values(kn, warp, lane) for lane in range(LANES)]
    mid = [[G[7, k1.lane_columns(warp, lane) + j] for j in range(k1.LANE_COLS)] for lane in range(LANES)]
    for level in range(k1.SPLIT_LEVELS):
        kd_bits = np.zeros((LANES, 2, 8))
        qd_bits = np.zeros((LANES, 2, 8))
        kinv_bits = np.zeros((LANES, 2, 8))
        for lane in range(LANES):
            g, t = divmod(lane, 4)
            for half in range(2):
                for j in range(8):
                    g_row = cum[lane][half][j]
                    if level == 0:
                        is_i = half == 1
                        ref = mid[lane][j]
                    else:
                        ref_row, is_i = k1.split_reference_row(level, g)
                        ref = cum[4 * ref_row + t][half][j]  # the shuffle's source lane
                    exponent = g_row - ref if is_i else ref - g_row
                    assert exponent <= 0.0  # every factor ≤ 1: no overflow at any rate
                    factor = np.exp2(exponent)
                    if is_i:
                        kd_bits[lane, half, j] = k_regs[lane][half][j] * factor
                        qd_bits[lane, half, j] = q_regs[lane][half][j] * factor
                    else:
                        kinv_bits[lane, half, j] = k_regs[lane][half][j] * factor
        for n in range(2 if level > 0 else 1):
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
                        if col < i and ((i ^ col) >> (3 - level)) == 1:
                            partial[2 * p + n, lane, c] += acc[lane, c]
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        for half in range(2):
            # The row's dot product over the warp's 32 columns (the two butterflies).
            dot = sum(q_regs[4 * g + u][half][j] * k_regs[4 * g + u][half][j] for u in range(4) for j in range(8))
            for c in (2 * half, 2 * half + 1):
                if g == 2 * t + c % 2:
                    partial[2 + half, lane, c] += dot
    return partial


def _warp_partials_midpoint(qs, kn, G, warp):
    regs = []
    for m, exponent in ((kn, G - G[7]), (qs, G - G[7]), (kn, G[7] - G)):
        regs.append([_lane_values(m * np.exp2(exponent), warp, lane) for lane in range(LANES)])
    partial = np.zeros((4, LANES, 4))
    for s in range(k1.K_STEPS):
        lo, hi = k1.fragment_value(s, 0), k1.fragment_value(s, 1)
        for p, x in enumerate(regs[:2]):
            a_regs = [[x[lane][0][lo], x[lane][1][lo], x[lane][0][hi], x[lane][1][hi]] for lane in range(LANES)]
            for n in range(2):
                b_regs = [[regs[2][lane][n][lo], regs[2][lane][n][hi]] for lane in range(LANES)]
                partial[2 * p + n] += np.array(_mma_m16n8k8(a_regs, b_regs))
    return partial


def _assembled(partials, p):
    product = np.zeros((CHUNK, CHUNK))
    for n in range(2):
        total = sum(part[2 * p + n] for part in partials)
        for lane in range(LANES):
            for c in range(4):
                i, j = k1.fragment_entry(lane, n, c)
                product[i, j] = total[lane, c]
    return product


@pytest.mark.parametrize("rate", [0.5, 40.0, 700.0])
def test_both_forms_give_the_pairwise_products(rate):
    rng = np.random.default_rng(int(rate * 10))
    qs, kn = rng.standard_normal((CHUNK, D)) * 0.1, rng.standard_normal((CHUNK, D)) * 0.1
    # Per-token log2 decays: fast on a random third of the (token, key) entries, none elsewhere.
    gamma = -rate * rng.random((CHUNK, D)) * (rng.random((CHUNK, D)) < 1 / 3) - 1e-3 * rng.random((CHUNK, D))
    G = np.cumsum(np.maximum(gamma, UNBOUNDED_GAMMA_FLOOR), axis=0)
    want_l, want_m = _pairwise(kn, kn, G, strict=True), _pairwise(qs, kn, G, strict=False)
    levels = [_warp_partials_levels(qs, kn, G, w) for w in range(k1.WARPS)]
    np.testing.assert_allclose(np.tril(_assembled(levels, 0), -1), want_l, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(np.tril(_assembled(levels, 1)), want_m, rtol=1e-10, atol=1e-13)
    if (G[0] - G[-1]).max() <= k1.MIDPOINT_RANGE:  # where the kernel takes the midpoint form
        mids = [_warp_partials_midpoint(qs, kn, G, w) for w in range(k1.WARPS)]
        np.testing.assert_allclose(np.tril(_assembled(mids, 0), -1), want_l, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(np.tril(_assembled(mids, 1)), want_m, rtol=1e-10, atol=1e-13)


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
