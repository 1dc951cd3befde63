"""CPU checks of the decode kernel's thread tile: which state values each lane holds, where
they live in a head state of either layout, and which lanes reduce together."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from cula_aot.kernels.decode import (  # noqa: E402
    MAX_TOKENS,
    ROWS_PER_WARP,
    VALUES,
    WARP,
    Tile,
    io_rounds,
    smem_bytes,
    threads,
)
from cula_aot.specs import DECODE_VARIANTS, decode_stage_bytes, decode_threads  # noqa: E402

D = 128


def _address(v, k, kv_layout):
    return k * D + v if kv_layout else v * D + k


@pytest.mark.parametrize("kv_layout", [False, True])
@pytest.mark.parametrize("bf16_state", [False, True])
def test_tile_covers_the_block_once_at_the_right_addresses(kv_layout, bf16_state):
    tile = Tile(kv_layout, bf16_state)
    assert tile.vt * tile.kt == VALUES and tile.lanes * tile.kt == D
    vectors = tile.vectors()
    assert sorted(r for _, regs in vectors for r in regs) == list(range(VALUES))
    assert all(len(regs) == tile.ce for _, regs in vectors)
    seen = {}
    for lane in range(WARP):
        group, j = tile.lane_parts(lane)
        row0 = group * tile.vt
        base = tile.lane_offset(row0, j)
        assert base % tile.ce == 0  # 16-byte vectors
        for static_off, regs in vectors:
            for e, reg in enumerate(regs):
                vi, ki = divmod(reg, tile.kt)
                v, k = row0 + vi, tile.key(j, ki)
                assert base + static_off + e == _address(v, k, kv_layout)
                assert (v, k) not in seen
                seen[(v, k)] = lane
    assert set(seen) == {(v, k) for v in range(ROWS_PER_WARP) for k in range(D)}
    # The reduction partners of a lane are exactly the lanes holding the same rows.
    for lane in range(WARP):
        group, _ = tile.lane_parts(lane)
        partners = {lane}
        for off in tile.xor_offsets:
            partners |= {p ^ off for p in partners}
        assert partners == {p for p in range(WARP) if tile.lane_parts(p)[0] == group}


@pytest.mark.parametrize("kv_layout", [False, True])
@pytest.mark.parametrize("bf16_state", [False, True])
def test_a_vector_instruction_reads_whole_sectors(kv_layout, bf16_state):
    """For each vector the warp loads, its 32 lanes' 16-byte pieces form runs of >= 32 bytes."""
    tile = Tile(kv_layout, bf16_state)
    size = 2 if bf16_state else 4
    for static_off, _ in tile.vectors():
        starts = sorted(
            (tile.lane_offset(tile.lane_parts(l)[0] * tile.vt, tile.lane_parts(l)[1]) + static_off) * size
            for l in range(WARP)
        )
        assert all(s % 16 == 0 for s in starts)
        sectors = {s // 32 for s in starts}
        assert len(sectors) * 32 == WARP * 16  # every touched 32-byte sector fully used


def test_block_shapes():
    for v_block, items in DECODE_VARIANTS:
        rows = v_block * items
        assert D % rows == 0 and v_block % ROWS_PER_WARP == 0
        assert threads(v_block) == decode_threads(v_block)
        # v and out staging: an 8-column piece per thread and round covers MAX_TOKENS tokens
        chunks = rows // 8
        assert threads(v_block) % chunks == 0
        assert io_rounds(v_block, items) * (threads(v_block) // chunks) >= MAX_TOKENS
        for bf16_state in (False, True):
            assert smem_bytes(v_block, items, bf16_state) <= 227 * 1024
            # the next item's staged vectors lie inside the stage (one item, refilled)
            vectors = len(Tile(False, bf16_state).vectors())
            staged = min(items - 1, 1) * threads(v_block) * vectors * 16
            assert staged <= decode_stage_bytes(v_block, items, bf16_state)


@pytest.mark.parametrize("kv_layout", [False, True])
def test_second_item_is_the_same_tile_further_down(kv_layout):
    tile = Tile(kv_layout, False)
    for rows in (32, 64):
        assert tile.lane_offset(rows, 3) == tile.lane_offset(0, 3) + tile.row_offset(rows)


@pytest.mark.parametrize("kv_layout", [False, True])
@pytest.mark.parametrize("bf16_state", [False, True])
def test_key_positions_are_a_permutation_read_without_bank_conflicts(kv_layout, bf16_state):
    tile = Tile(kv_layout, bf16_state)
    positions = {}
    for j in range(tile.lanes):
        for ki in range(tile.kt):
            p = tile.key_pos(j, ki)
            assert tile.pos_of_key(tile.key(j, ki)) == p
            positions[p] = tile.key(j, ki)
    assert sorted(positions) == list(range(D)) and sorted(positions.values()) == list(range(D))
    for ki0, count in tile.key_chunks():
        # a run is one 16-byte vector per lane ...
        for j in range(tile.lanes):
            assert [tile.key_pos(j, ki0 + c) for c in range(count)] == list(
                range(tile.key_pos(j, ki0), tile.key_pos(j, ki0) + 4)
            )
        # ... and each 8-lane phase of the warp's read covers 128 contiguous bytes: no conflicts
        for phase in range(WARP // 8):
            starts = {tile.key_pos(tile.lane_parts(lane)[1], ki0) * 4 for lane in range(8 * phase, 8 * phase + 8)}
            banks = [(s // 4 + w) % 32 for s in starts for w in range(4)]
            assert len(banks) == len(set(banks))


class _LaneVectors:
    """Stand-ins for the DSL calls of ``common.butterfly_reduce_scatter``: a value is a numpy array over the 32
    lanes of a warp, a butterfly shuffle reads the partner lane's entry."""

    @staticmethod
    def select_(cond, if_value, else_value):
        return np.where(cond, if_value, else_value)

    @staticmethod
    def Float32(x):  # noqa: N802 (the DSL's name)
        return x

    class arch:  # noqa: N801
        @staticmethod
        def shuffle_sync_bfly(x, offset):
            return x[np.arange(WARP) ^ offset]


@pytest.mark.parametrize("kv_layout", [False, True])
@pytest.mark.parametrize("bf16_state", [False, True])
def test_reduce_rows_leaves_each_lane_the_group_totals_of_its_row(kv_layout, bf16_state, monkeypatch):
    """Runs the kernel's own reduce-scatter on lane vectors, then the gather of u."""
    from cula_aot.kernels import common, decode

    tile = Tile(kv_layout, bf16_state)
    monkeypatch.setattr(common, "cutlass", _LaneVectors)
    monkeypatch.setattr(common, "cute", _LaneVectors)
    rng = np.random.default_rng(7)
    dk = [rng.integers(-1000, 1000, WARP).astype(np.float64) for _ in range(tile.vt)]
    dq = [rng.integers(-1000, 1000, WARP).astype(np.float64) for _ in range(tile.vt)]
    parts = [tile.lane_parts(lane) for lane in range(WARP)]
    group = np.array([g for g, _ in parts])
    j = np.array([jj for _, jj in parts])
    dk_row, dq_row = decode._reduce_rows(tile, dk, dq, j)
    for lane in range(WARP):
        row = tile.row_of(int(j[lane]))
        members = group == group[lane]
        assert dk_row[lane] == dk[row][members].sum() and dq_row[lane] == dq[row][members].sum()
    for row in range(tile.vt):
        src = tile.lane_of(group, tile.holder(row))
        assert (group[src] == group).all() and all(tile.row_of(int(x)) == row for x in j[src])
        assert (dk_row[src] == np.array([dk[row][group == g].sum() for g in group])).all()
