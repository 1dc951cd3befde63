"""benchmarks/pieces_model.py's replay of the fused pieces with the kernel's waits: an item whose
warm-up does not certify starts its own tiles when its predecessor ends (CPU only)."""

import pytest
import torch

from cula_aot.layout import FLAG_FINAL_STATE, FLAG_INITIAL_STATE
from cula_aot.ops import cp_plan, prefill_plans

pm = pytest.importorskip("benchmarks.pieces_model", reason="benchmarks/ is not part of the installed wheel")


def table(tiles: int, piece: int):
    seqs = cp_plan.sequences(1, 0, [0, tiles * 16])
    return prefill_plans._fused_piece_rows(cp_plan.fused_pieces(seqs, piece), FLAG_INITIAL_STATE, FLAG_FINAL_STATE)


@pytest.mark.parametrize("warmup", [2, 3])
def test_certified_pieces_run_side_by_side_and_uncertified_ones_in_a_chain(warmup):
    rows, first = table(64, 16), [0]
    item, tile = cp_plan.FUSED_ITEM_US, cp_plan.FUSED_TILE_US
    certified = pm.makespan_with_waits(rows, torch.full((64, 1), -100.0), first, 1, warmup, sms=8)
    assert certified == pytest.approx(item + (warmup + 16) * tile)
    waiting = pm.makespan_with_waits(rows, torch.zeros(64, 1), first, 1, warmup, sms=8)
    assert waiting == pytest.approx(item + 64 * tile)
    # One uncertified piece (the third) waits for the second, which certified.
    bounds = torch.full((64, 1), -100.0)
    bounds[32 - warmup : 32] = 0.0
    one = pm.makespan_with_waits(rows, bounds, first, 1, warmup, sms=8)
    assert one == pytest.approx(item + (warmup + 16) * tile + 16 * tile)
