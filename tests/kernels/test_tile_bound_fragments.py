"""The tile bound's tensor-core dataflow (``kernels/tile_bound.py``) emulated on the CPU, warp by
warp: a record laid out as K1 writes it, ``ldmatrix`` (``.trans``), ``mma.sync.m16n8k16`` and
``movmatrix`` emulated as the PTX ISA defines them, the kernel's own register choices
(``w_register``, ``x_operands``, ``kr_a_operand``, the lane offsets), and the two Gram matrices it
accumulates checked against X·Xᵀ and kr·krᵀ.  Needs CuTeDSL (the kernel module imports it)."""

import random

import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import tile_bound, tile_chain  # noqa: E402
from cula_aot.layout import CHUNK, D, WORKSPACE_PART_OFFSETS, k_inter_index  # noqa: E402
from tests.kernels.test_fragment_maps import _ldmatrix_x4  # noqa: E402

LANES = 32


def _mma(a, b, c):
    """m16n8k16 on warp registers (lists of 32 lane values): A's four pair registers, B's two,
    C's four floats; returns D's four."""
    A = [[0.0] * 16 for _ in range(16)]
    B = [[0.0] * 8 for _ in range(16)]
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for reg, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row][k], A[row][k + 1] = a[reg][lane]
        for reg, k in enumerate((2 * t, 2 * t + 8)):
            B[k][g], B[k + 1][g] = b[reg][lane]
    out = [[0.0] * LANES for _ in range(4)]
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for reg, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            out[reg][lane] = c[reg][lane] + sum(A[row][k] * B[k][col] for k in range(16))
    return out


def _movmatrix(register):
    """The transposed 8×8 matrix, in the same layout (row lane // 4, columns 2·(lane % 4) + {0, 1})."""
    m = [[None] * 8 for _ in range(8)]
    for lane in range(LANES):
        m[lane // 4][2 * (lane % 4)], m[lane // 4][2 * (lane % 4) + 1] = register[lane]
    return [(m[2 * (lane % 4)][lane // 4], m[2 * (lane % 4) + 1][lane // 4]) for lane in range(LANES)]


def _as_a(acc):
    """``warp_mma.accumulators_as_a`` on warp registers (no rounding: the dataflow, not precision)."""
    return [[(acc[2 * j][lane], acc[2 * j + 1][lane]) for lane in range(LANES)] for j in range(4)]


def _lane_loads(memory, base, offset, transpose=False):
    """A warp's ``ldmatrix.x4`` at ``base + offset(lane)``, as four warp registers."""
    regs = _ldmatrix_x4(memory, [base + offset(lane) for lane in range(LANES)], transpose)
    return [[regs[lane][m] for lane in range(LANES)] for m in range(4)]


def test_the_kernel_dataflow_accumulates_both_grams():
    rng = random.Random(7)
    kd = [[rng.uniform(-1, 1) for _ in range(D)] for _ in range(CHUNK)]
    kr = [[rng.uniform(-1, 1) for _ in range(D)] for _ in range(CHUNK)]
    inv = [[(1.0 if i == j else rng.uniform(-1, 1)) if j <= i else 0.0 for j in range(CHUNK)] for i in range(CHUNK)]
    b = [rng.uniform(0, 1) for _ in range(CHUNK)]
    memory = {}
    for part, matrix in (("kd", kd), ("kr", kr)):
        for r in range(CHUNK):
            for c in range(D):
                memory[WORKSPACE_PART_OFFSETS[part] + 2 * k_inter_index(r, c)] = matrix[r][c]
    for i in range(CHUNK):
        for j in range(CHUNK):
            memory[WORKSPACE_PART_OFFSETS["inv"] + 2 * (CHUNK * i + j)] = inv[i][j]

    zero = [[0.0] * LANES for _ in range(4)]
    gram_x, gram_kr = [zero, zero], [zero, zero]  # per token n-tile, four C registers each
    for block in range(D // 16):
        step = block * tile_bound.IMAGE_K_STEP_BYTES
        kd_pairs = _lane_loads(memory, WORKSPACE_PART_OFFSETS["kd"] + step, tile_chain.image_trans_lane_offset, True)
        w = [[0.0] * LANES for _ in range(8)]
        for lane in range(LANES):
            t = lane % 4
            for i in range(8):
                n_tile, half, column = i // 4, (i // 2) % 2, i % 2
                w[i][lane] = (
                    kd_pairs[tile_bound.w_register(n_tile, half)][lane][column] * b[8 * n_tile + 2 * t + column]
                )
        # tile_chain.tile_u: Uᵀ = Wᵀ·INVᵀ, B from the row-major INV.
        b_inv = _lane_loads(memory, WORKSPACE_PART_OFFSETS["inv"], tile_chain.square_lane_offset)
        a_w = _as_a(w)
        u = [value for n in range(2) for value in _mma(a_w, b_inv[2 * n : 2 * n + 2], zero)]
        a_x, b_x = tile_bound.x_operands(_as_a(u), _movmatrix)
        gram_x = [_mma(a_x, b_x[n], gram_x[n]) for n in range(2)]
        kr_b = _lane_loads(memory, WORKSPACE_PART_OFFSETS["kr"] + step, tile_chain.image_lane_offset)
        gram_kr = [_mma(tile_bound.kr_a_operand(kr_b), kr_b[2 * n : 2 * n + 2], gram_kr[n]) for n in range(2)]

    x = [[sum(inv[r][s] * b[s] * kd[s][c] for s in range(CHUNK)) for c in range(D)] for r in range(CHUNK)]
    for grams, rows in ((gram_x, x), (gram_kr, kr)):
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            for n in range(2):
                for reg, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                    want = sum(rows[row][c] * rows[8 * n + col][c] for c in range(D))
                    assert grams[n][reg][lane] == pytest.approx(want, rel=1e-9, abs=1e-9)
