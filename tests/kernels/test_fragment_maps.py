"""The tensor-core kernels' lane → address maps against an emulation of ``ldmatrix`` (CPU).

The K2 addressing helpers are plain integer functions, so they run here on Python ints: each
test lays a known matrix out as the kernel's shared memory does (a K_INTER image, a row-major
16×16 bf16 matrix, a warp's staged v block), emulates ``ldmatrix.x4`` (optionally ``.trans``) as
the PTX ISA defines it, and checks that every lane receives exactly the mma.sync fragment
elements the kernel's math assumes.  Needs CuTeDSL (the kernel modules import it).
"""

import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels import cp_merge, k2_recurrence, prepare_tile, tile_chain  # noqa: E402
from cula_aot.layout import CHUNK, D, k_inter_index  # noqa: E402

LANES = 32


def _ldmatrix_x4(memory, row_addresses, transpose=False):
    """regs[lane][m] = the (low, high) b16 pair lane receives from matrix m; lanes 8m..8m+7 give
    the byte addresses of matrix m's eight 16-byte rows."""
    regs = [[None] * 4 for _ in range(LANES)]
    for m in range(4):
        rows = row_addresses[8 * m : 8 * m + 8]
        mat = [[memory[rows[r] + 2 * c] for c in range(8)] for r in range(8)]
        for lane in range(LANES):
            if transpose:
                r, c = 2 * (lane % 4), lane // 4
                regs[lane][m] = (mat[r][c], mat[r + 1][c])
            else:
                r, c = lane // 4, 2 * (lane % 4)
                regs[lane][m] = (mat[r][c], mat[r][c + 1])
    return regs


def _k_inter_memory(value):
    """A K_INTER image of the 16×128 matrix value(r, c), byte address → element."""
    return {2 * k_inter_index(r, c): value(r, c) for r in range(CHUNK) for c in range(D)}


def _token_key(r, c):
    return ("x", r, c)


def test_kd_qd_b_fragments_come_straight_from_the_k_inter_image():
    memory = _k_inter_memory(_token_key)
    for kt in range(D // 16):
        addresses = [tile_chain.image_lane_offset(lane) + kt * 2 * CHUNK * 16 for lane in range(LANES)]
        regs = _ldmatrix_x4(memory, addresses)
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            for n in range(2):  # B[k][n] = kd[token 8n + n][key 16kt + k]: (k = 2t.., n = g), (k = 2t+8.., n = g)
                token = 8 * n + g
                assert regs[lane][2 * n] == (_token_key(token, 16 * kt + 2 * t), _token_key(token, 16 * kt + 2 * t + 1))
                assert regs[lane][2 * n + 1] == (
                    _token_key(token, 16 * kt + 2 * t + 8),
                    _token_key(token, 16 * kt + 2 * t + 9),
                )


def test_kr_transposed_b_fragments_for_the_state_update():
    memory = _k_inter_memory(_token_key)
    for pair in range(D // 16):
        addresses = [tile_chain.image_trans_lane_offset(lane) + pair * 2 * CHUNK * 16 for lane in range(LANES)]
        regs = _ldmatrix_x4(memory, addresses, transpose=True)
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            for n in range(2):  # B[token][key 8j + n] = kr[token][key]
                key = 8 * (2 * pair + n) + g
                assert regs[lane][2 * n] == (_token_key(2 * t, key), _token_key(2 * t + 1, key))
                assert regs[lane][2 * n + 1] == (_token_key(2 * t + 8, key), _token_key(2 * t + 9, key))


def test_square_matrices_give_the_transposed_b_operand():
    # Uᵀ = Wᵀ·INVᵀ needs B[j][i] = INV[i][j]: pairs along a row of the row-major INV.
    memory = {2 * (CHUNK * i + j): ("inv", i, j) for i in range(CHUNK) for j in range(CHUNK)}
    regs = _ldmatrix_x4(memory, [tile_chain.square_lane_offset(lane) for lane in range(LANES)])
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for n in range(2):
            i = 8 * n + g
            assert regs[lane][2 * n] == (("inv", i, 2 * t), ("inv", i, 2 * t + 1))
            assert regs[lane][2 * n + 1] == (("inv", i, 2 * t + 8), ("inv", i, 2 * t + 9))


def test_staged_v_block_reads_back_as_the_accumulator_fragment():
    row_bytes = k2_recurrence.WARP_COLUMNS * 2
    memory = {}
    for lane in range(LANES):  # each lane's 16-byte cp.async piece
        row, half = tile_chain.v_chunk(lane)
        for e in range(8):
            address = row * row_bytes + half * 16 + 2 * e
            assert address not in memory, "two lanes stage the same element"
            memory[address] = ("v", row, 8 * half + e)
    assert len(memory) == CHUNK * k2_recurrence.WARP_COLUMNS
    regs = _ldmatrix_x4(memory, [tile_chain.square_lane_offset(lane) for lane in range(LANES)], transpose=True)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for i in range(8):  # value i of the Wᵀ fragment: V column g + 8·half, token 8·n_tile + 2t + column
            n_tile, half, column = tile_chain.fragment_value(i)
            assert regs[lane][2 * n_tile + half][column] == ("v", 8 * n_tile + 2 * t + column, g + 8 * half)


def test_accumulator_fragments_cover_their_tiles_once():
    # K1 phases C/D: a warp's 16×8 C fragment of n-tile n covers rows 0..15 × columns 8n..8n+7.
    for n in range(2):
        seen = [prepare_tile.fragment_entry(lane, n, c) for lane in range(LANES) for c in range(4)]
        assert sorted(seen) == [(i, j) for i in range(CHUNK) for j in range(8 * n, 8 * n + 8)]
    # Merge: its warps × (m-tiles × n-tiles) cover the 128 × v_block carry block once.
    warps = cp_merge.THREADS // LANES
    for v_block in (8, 16):
        seen = [
            cp_merge._entry_of_value(warp, lane, i, v_block // 8)
            for warp in range(warps)
            for lane in range(LANES)
            for i in range(cp_merge._M_TILES * v_block // 8 * 4)
        ]
        assert sorted(seen) == [(k, c) for k in range(D) for c in range(v_block)]
