"""Phase C under an unbounded gate (``prepare_tile.unbounded_operands``) emulated per lane on the
CPU.  The gate's per-token floor (``UNBOUNDED_GAMMA_FLOOR``) keeps every tile's cumsum, as the
kernel's fp32 scan forms it, within BLOCK_RANGE of 0, so one reference P = G[15]/2 serves every
pair with factors ≤ 2^(BLOCK_RANGE / 2) however fast the gate decays; the four warps' partials
then sum to exactly the pairwise products Σ_k a_ik·k̂_jk·2^(G_ik − G_jk) (j < i for L, j ≤ i for
Mqk), and at the floor itself the kernel's fp32 and tf32 operands keep tf32 accuracy.  Needs
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


def _floored_cumsum(gamma):
    """G in fp32 as ``prepare_tile.gate_cumsum`` forms it from the floored γ: each half's rows by
    ``row_scan``'s three shuffle steps, the lower half plus the upper half's total."""
    x = np.maximum(gamma.astype(np.float32), np.float32(UNBOUNDED_GAMMA_FLOOR)).reshape(2, 8, -1)
    for offset in (1, 2, 4):
        below = np.zeros_like(x)
        below[:, offset:] = x[:, :-offset]
        x = below + x
    return np.concatenate([x[0], x[0, 7] + x[1]])


def _warp_partials(qs, kn, G, warp):
    """One warp's partials as the kernel forms them ([f][lane][c], ``store_product_partials``'
    layout): per element rise = 2^(G − P), fall = 2^(P − G) around P = G[15]/2, kd = k̂·rise,
    qd = q̂·scale·rise, kinv = k̂·fall; the images 2^G = rise·c, 2^(G[15] − G) = fall·c."""
    regs = {}
    for lane in range(LANES):
        g15 = [G[15, k1.lane_columns(warp, lane) + j] for j in range(k1.LANE_COLS)]
        cum, q_regs, k_regs = (_lane_values(m, warp, lane) for m in (G, qs, kn))
        for half in range(2):
            for j in range(k1.LANE_COLS):
                ref, g, k = g15[j] / 2, cum[half][j], k_regs[half][j]
                rise, fall, c = np.exp2(g - ref), np.exp2(ref - g), np.exp2(ref)
                assert max(rise, fall) <= 2.0 ** (k1.BLOCK_RANGE / 2) and c >= 2.0 ** (-k1.BLOCK_RANGE / 2)
                regs[lane, half, j] = (k * rise, q_regs[half][j] * rise, k * fall)
    partial = np.zeros((4, LANES, 4))
    for s in range(k1.K_STEPS):
        lo, hi = k1.fragment_value(s, 0), k1.fragment_value(s, 1)
        for p in range(2):
            a_regs = [[regs[lane, h, j][p] for j in (lo, hi) for h in range(2)] for lane in range(LANES)]
            for n in range(2):
                b_regs = [[regs[lane, n, lo][2], regs[lane, n, hi][2]] for lane in range(LANES)]
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


def test_every_floored_tile_fits_one_reference():
    """The floor bounds a tile's span by 16·|floor| ≤ BLOCK_RANGE in every column, whatever the
    gate gives (rates up to fp32's range, −inf, rows past a sequence's end at 0): the kernel's
    only phase C form serves every tile."""
    assert CHUNK * -UNBOUNDED_GAMMA_FLOOR <= k1.BLOCK_RANGE
    rng = np.random.default_rng(5)
    for rate in (0.5, 15.0, 40.0, 700.0, 1e6, 3e38):
        gamma = -rate * rng.random((CHUNK, D)) * (rng.random((CHUNK, D)) < 0.7)
        gamma[rng.random((CHUNK, D)) < 0.05] = -np.inf
        gamma[CHUNK - rng.integers(0, CHUNK) :] = 0.0  # rows past the end
        G = _floored_cumsum(gamma)
        assert np.isfinite(G).all() and (G <= 0).all()
        assert (-G[15]).max() <= CHUNK * -UNBOUNDED_GAMMA_FLOOR
        assert np.abs(G.astype(np.float64) - G[15] / 2).max() <= k1.BLOCK_RANGE / 2  # both factors


@pytest.mark.parametrize("rate", [0.5, 12.0, 25.0, 40.0, 60.0, 150.0, 700.0])
def test_phase_c_gives_the_pairwise_products(rate):
    rng = np.random.default_rng(int(rate * 10))
    qs, kn = rng.standard_normal((CHUNK, D)) * 0.1, rng.standard_normal((CHUNK, D)) * 0.1
    # Per-token log2 decays: up to ``rate`` on a random half of the (token, key) entries.
    gamma = -rate * rng.random((CHUNK, D)) * (rng.random((CHUNK, D)) < 0.5) - 1e-3 * rng.random((CHUNK, D))
    G = _floored_cumsum(gamma).astype(np.float64)
    want_l, want_m = _pairwise(kn, kn, G, strict=True), _pairwise(qs, kn, G, strict=False)
    partials = [_warp_partials(qs, kn, G, w) for w in range(k1.WARPS)]
    np.testing.assert_allclose(np.tril(_assembled(partials, 0), -1), want_l, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(np.tril(_assembled(partials, 1)), want_m, rtol=1e-9, atol=1e-13)


def _tf32(x):
    """fp32 operands as the MMA reads them after ``warp_mma.tf32_ready`` (half a tf32 ulp added to
    the bits, the low 13 ignored), subnormals flushed to 0: the stricter of the two ways tensor
    cores may treat them."""
    x = x.astype(np.float32)
    x = np.where(np.abs(x) < np.float32(2.0**-126), np.float32(0.0), x)
    bits = (x.view(np.uint32).astype(np.uint64) + 0x1000) & 0xFFFFE000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def test_operands_at_the_floor_keep_tf32_accuracy():
    """Every key at the floor on every token (a span of exactly 224): the last rows' operands are
    q̂·scale·2^-112 ≈ 2^-119 (a component below ~2^-14 of its row still goes subnormal, and is
    flushed here), and L and Mqk stay within tf32's accuracy of the pairwise products (rel.
    Frobenius; ~4e-4 off the floor)."""
    rng = np.random.default_rng(11)
    G = _floored_cumsum(np.full((CHUNK, D), -np.inf)).astype(np.float64)
    rise, fall = (np.exp2(x).astype(np.float32) for x in (G - G[15] / 2, G[15] / 2 - G))
    for _ in range(8):
        q, k = (rng.standard_normal((CHUNK, D)) for _ in range(2))
        qs = q / np.linalg.norm(q, axis=1, keepdims=True) * D**-0.5
        kn = k / np.linalg.norm(k, axis=1, keepdims=True)
        kd, qd, kinv = (_tf32(x.astype(np.float32) * f) for x, f in ((kn, rise), (qs, rise), (kn, fall)))
        assert np.abs(qd[15]).max() < 2.0**-100  # the floor's smallest operands
        for got, want in (
            (np.tril(kd @ kinv.T, -1), _pairwise(kn, kn, G, True)),
            (np.tril(qd @ kinv.T), _pairwise(qs, kn, G, False)),
        ):
            assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)
