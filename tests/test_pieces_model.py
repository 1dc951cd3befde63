"""The fused-pieces makespan model (``benchmarks/pieces_model.py``) on cases worked by hand."""

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(
    not (ROOT / "benchmarks" / "pieces_model.py").exists(), reason="benchmarks/ is not part of the installed wheel"
)


@pytest.fixture(scope="module")
def pm():
    return importlib.import_module("benchmarks.pieces_model")


def test_pieces_are_equal_cuts_and_only_later_pieces_warm_up(pm):
    # 20 tiles in pieces of at most 8: three pieces of 7, 7 and 6 tiles, the last two plus 3.
    assert pm.piece_items([20 * 16], heads=2, piece=8) == [7, 7, 10, 10, 9, 9]
    # A partial last tile counts as a tile; a sequence shorter than a piece is one item.
    assert pm.piece_items([17, 5], heads=1, piece=8) == [2, 1]


def test_makespan_is_longest_first_list_scheduling(pm):
    assert pm.makespan_us([10, 10, 10], sms=2, tile_us=1.0, item_us=0.0) == 20.0
    # Longest first: 5 and 4 + 1 on two SMs finish at 5, not 5 + 4 or 4 + 5.
    assert pm.makespan_us([1, 4, 5], sms=2, tile_us=1.0, item_us=0.0) == 5.0
    assert pm.makespan_us([3], sms=4, tile_us=2.0, item_us=1.0) == 7.0


def test_best_piece_fills_one_wave_of_the_machine(pm):
    # H16 1x8192: 512 tiles a chain, 8 pieces of 64 make 128 items on 132 SMs; the longest runs
    # 64 + 3 warm-up tiles.
    us, piece, items = pm.best_piece([8192], 16)
    assert (piece, items) == (64, 128)
    assert us == pytest.approx(pm.ITEM_US + 67 * pm.TILE_US)
