"""K1's register layout against the PTX fragment tables (CPU, Python ints and numpy).

K1 keeps each lane's 2 rows × 8 consecutive columns of a tile in registers and feeds them to
``mma.sync.m16n8k8`` (tf32) as A and B fragments after renumbering the keys
(``prepare_tile.fragment_value``).  These tests emulate the MMA as the PTX ISA defines its
fragments and check that the split-over-warps product K1 assembles is exactly ``A·Bᵀ``, that the
lanes' image rows tile the K_INTER image, that the scan's partner lanes hold the right rows,
and that phase D's register products (m16n8k16, ``movmatrix`` and fp16 packing emulated per
lane) invert I + L.  Needs CuTeDSL (the kernel module imports it).
"""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import prepare_tile as k1  # noqa: E402
from cula_aot.layout import CHUNK, D, k_inter_index  # noqa: E402

LANES = 32


def _lane_values(matrix, warp, lane):
    """values[half][j] = matrix[row half of the lane, lane_columns + j], as K1's registers."""
    col0 = k1.lane_columns(warp, lane)
    return [[matrix[r, col0 + j] for j in range(k1.LANE_COLS)] for r in k1.lane_rows(lane)]


def _mma_m16n8k8(a_regs, b_regs):
    """D fragments (per lane, 4 values) of one m16n8k8 from the lanes' A (4) and B (2) registers,
    interpreted as the PTX ISA's tf32 tables: a0..a3 = A(g, t), A(g+8, t), A(g, t+4), A(g+8, t+4);
    b0, b1 = B(t, g), B(t+4, g); c0..c3 = C(g, 2t), C(g, 2t+1), C(g+8, 2t), C(g+8, 2t+1)."""
    a = np.full((16, 8), np.nan)
    b = np.full((8, 8), np.nan)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for reg, (i, k) in zip(a_regs[lane], [(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)]):
            a[i, k] = reg
        for reg, k in zip(b_regs[lane], [t, t + 4]):
            b[k, g] = reg
    assert not np.isnan(a).any() and not np.isnan(b).any()
    c = a @ b
    return [
        [c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]]
        for g, t in (divmod(lane, 4) for lane in range(LANES))
    ]


def test_split_over_warps_products_are_a_times_b_transposed():
    rng = np.random.default_rng(7)
    operands = [rng.standard_normal((CHUNK, D)) for _ in range(3)]  # kd, qd, kinv
    kd, qd, kinv = operands
    # partial[warp][f][lane] as K1 stores them: f = 2·p + n.
    partial = np.zeros((k1.WARPS, 4, LANES, 4))
    for warp in range(k1.WARPS):
        regs = [[_lane_values(m, warp, lane) for lane in range(LANES)] for m in operands]
        for s in range(k1.K_STEPS):
            lo, hi = k1.fragment_value(s, 0), k1.fragment_value(s, 1)
            for p, x in enumerate(regs[:2]):
                a_regs = [[x[lane][0][lo], x[lane][1][lo], x[lane][0][hi], x[lane][1][hi]] for lane in range(LANES)]
                for n in range(2):
                    b_regs = [[regs[2][lane][n][lo], regs[2][lane][n][hi]] for lane in range(LANES)]
                    partial[warp, 2 * p + n] += np.array(_mma_m16n8k8(a_regs, b_regs))
    for p, a in enumerate((kd, qd)):
        product = np.zeros((CHUNK, CHUNK))
        for n in range(2):
            # The reducing warp w = 2·p + n sums the four warps' partials of product f = w.
            total = partial[:, 2 * p + n].sum(axis=0)
            for lane in range(LANES):
                for c in range(4):
                    i, j = k1.fragment_entry(lane, n, c)
                    product[i, j] = total[lane, c]
        np.testing.assert_allclose(product, a @ kinv.T, rtol=1e-12, atol=1e-12)


def test_fragment_value_is_a_bijection_of_a_warps_columns():
    for lane in range(4):
        seen = sorted(k1.lane_columns(0, lane) + k1.fragment_value(s, u) for s in range(k1.K_STEPS) for u in (0, 1))
        # Over the four lanes t of a row, logical keys (s, t, u) cover the 32 columns once.
        assert seen == sorted(k1.LANE_COLS * lane + j for j in range(k1.LANE_COLS))
    columns = {k1.lane_columns(w, lane) + j for w in range(k1.WARPS) for lane in range(LANES) for j in range(8)}
    assert columns == set(range(D))


def test_image_rows_are_contiguous_and_tile_the_k_inter_image():
    covered = []
    for warp in range(k1.WARPS):
        for lane in range(LANES):
            col0 = k1.lane_columns(warp, lane)
            assert col0 % k1.LANE_COLS == 0
            for r in k1.lane_rows(lane):
                first = k_inter_index(r, col0)
                # One 16-byte store: 8 consecutive elements, 16-byte aligned.
                assert [k_inter_index(r, col0 + j) for j in range(k1.LANE_COLS)] == list(range(first, first + 8))
                assert first % 8 == 0
                covered.extend(range(first, first + 8))
    assert sorted(covered) == list(range(CHUNK * D))


def test_scan_partners_hold_the_same_column_in_consecutive_rows():
    for warp in range(k1.WARPS):
        for lane in range(LANES):
            for step in (4, 8, 16):
                if lane >= step:
                    source = lane - step
                    assert k1.lane_columns(warp, source) == k1.lane_columns(warp, lane)
                    assert k1.lane_rows(source)[0] == k1.lane_rows(lane)[0] - step // 4
            last = k1.last_row_lane(lane)
            assert k1.lane_rows(last) == (7, 15) and k1.lane_columns(warp, last) == k1.lane_columns(warp, lane)


def _emulated_f16_intrinsics():
    """numpy stand-ins for phase D's warp intrinsics, per lane as the PTX ISA defines them: a
    register is a [lane] array (fp32 values) or [lane, 2] (an fp16 pair, low half first)."""

    def pack(low, high):
        return np.stack([np.asarray(low), np.asarray(high)], axis=1).astype(np.float16)

    def movmatrix_trans(reg):
        # Lane l holds row l // 4, columns 2·(l % 4) + {0, 1} of an 8 × 8 matrix.
        m = np.zeros((8, 8), np.float16)
        for lane in range(LANES):
            m[lane // 4, 2 * (lane % 4) : 2 * (lane % 4) + 2] = reg[lane]
        return np.stack([m.T[lane // 4, 2 * (lane % 4) : 2 * (lane % 4) + 2] for lane in range(LANES)])

    def mma(a_regs, b_regs, c):
        a = np.zeros((16, 16))
        b = np.zeros((16, 8))
        for lane in range(LANES):
            g, t = divmod(lane, 4)
            for reg, (row, col) in zip(a_regs, [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                a[row, col : col + 2] = reg[lane]
            for reg, k in zip(b_regs, [2 * t, 2 * t + 8]):
                b[k : k + 2, g] = reg[lane]
        d = a @ b
        lanes = [divmod(lane, 4) for lane in range(LANES)]
        return [
            np.array([d[g + 8 * (v // 2), 2 * t + v % 2] for g, t in lanes])
            + np.broadcast_to(np.asarray(c[v], float), LANES)
            for v in range(4)
        ]

    return pack, movmatrix_trans, mma


def _fragments(matrix):
    """A 16 × 16 matrix as C fragments: [n-tile][value] of [lane] arrays (``fragment_entry``)."""
    return [
        [np.array([matrix[k1.fragment_entry(lane, n, c)] for lane in range(LANES)]) for c in range(4)] for n in range(2)
    ]


def test_register_phase_d_is_the_inverse_of_i_plus_l(monkeypatch):
    # register_inverse's products on emulated m16n8k16 / movmatrix / fp16 packing: blocks, the
    # transposed B operands and the three P ← P + P·X, X ← X² rounds give (I + L)^-1 for a strictly
    # lower L with |L| ≤ 1 (fp16 operands, fp32-level sums).
    pack, transpose, mma = _emulated_f16_intrinsics()
    monkeypatch.setattr(k1, "pack_f16x2", pack)
    monkeypatch.setattr(k1, "movmatrix_trans", transpose)
    monkeypatch.setattr(k1, "mma_f16_m16n8k16", mma)
    monkeypatch.setattr(k1.cutlass, "Float32", float)
    rng = np.random.default_rng(11)
    lower = np.tril(rng.uniform(-1, 1, (CHUNK, CHUNK)) * 0.5, -1)
    p = k1.neumann_products(_fragments(np.eye(CHUNK) - lower), _fragments(lower))
    inv = np.zeros((CHUNK, CHUNK))
    for n in range(2):
        for c in range(4):
            for lane in range(LANES):
                inv[k1.fragment_entry(lane, n, c)] = p[n][c][lane]
    np.testing.assert_allclose(inv @ (np.eye(CHUNK) + lower), np.eye(CHUNK), atol=2e-3)
