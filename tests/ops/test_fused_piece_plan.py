"""The fused pieces' planner (``cula_aot.ops.cp_plan``: ``fused_pieces``, ``piece_items``,
``makespan_us``, ``fused_piece_tiles``) on cases worked by hand, and its invariants on random
lengths."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cula_aot.layout import MAX_SEQS
from cula_aot.ops import cp_plan
from cula_aot.specs import PIECE_WARMUP_TILES


def test_pieces_are_equal_cuts_and_later_pieces_warm_up():
    # 20 tiles in pieces of at most 8: 7, 7 and 6 tiles, the later two plus the warm-up; items in
    # launch order, each row's heads together.
    w = PIECE_WARMUP_TILES
    assert cp_plan.piece_items([20 * 16], heads=2, piece=8) == [7, 7, 7 + w, 7 + w, 6 + w, 6 + w]
    # A partial last tile counts as a tile; a sequence shorter than a piece is one item; the
    # pieces with a successor launch before every sequence's last.
    assert cp_plan.piece_items([17, 5], heads=1, piece=8) == [2, 1]
    assert cp_plan.piece_items([32 * 16, 8 * 16], heads=1, piece=16, warmup=3) == [16, 8, 19]


def test_launch_order_puts_pieces_with_a_successor_first_and_predecessors_before():
    # Sequences of 3, 1 and 2 pieces: (sequence, piece index).
    order = cp_plan.piece_order([3, 1, 2])
    assert order == [(0, 0), (2, 0), (0, 1), (1, 0), (2, 1), (0, 2)]
    assert all(order.index((s, n - 1)) < order.index((s, n)) for s, n in order if n)
    # A warm-up never reaches before its sequence's start.
    assert cp_plan.piece_items([4 * 16], heads=1, piece=1, warmup=3) == [1, 2, 3, 4]


def test_pieces_cover_every_sequence_in_order():
    seqs = cp_plan.sequences(1, 0, [0, 330, 330, 337])  # 330 tokens, an empty sequence, 7
    pieces = cp_plan.fused_pieces(seqs, piece_tiles=8)
    assert [[(p.first_token, p.num_tokens) for p in seq] for seq in pieces] == [
        [(0, 112), (112, 112), (224, 106)],  # 21 tiles: 7 + 7 + 7, the last partial
        [(330, 0)],  # one empty piece: its final state is its initial state
        [(330, 7)],
    ]


def test_makespan_deals_items_in_launch_order():
    assert cp_plan.makespan_us([10, 10, 10], sms=2, tile_us=1.0, item_us=0.0) == 20.0
    # In order, not longest first: 1 and 4 start, 5 follows the 1.
    assert cp_plan.makespan_us([1, 4, 5], sms=2, tile_us=1.0, item_us=0.0) == 6.0
    assert cp_plan.makespan_us([3], sms=4, tile_us=2.0, item_us=1.0) == 7.0


def test_best_piece_fills_the_machine():
    # H12 1x2048: 128 tiles a chain; pieces of 12 tiles make 11 rows x 12 heads = 132 items, one
    # per SM, the longest 12 + the warm-up tiles.
    piece = cp_plan.fused_piece_tiles([2048], 12, 132)
    items = cp_plan.piece_items([2048], 12, piece)
    assert (piece, len(items)) == (12, 132)
    assert cp_plan.makespan_us(items, 132) == pytest.approx(
        cp_plan.FUSED_ITEM_US + (12 + PIECE_WARMUP_TILES) * cp_plan.FUSED_TILE_US
    )
    # Enough chains to fill the machine already: no cut (H16 8x2048: 128 chains of 128 tiles).
    assert cp_plan.fused_piece_tiles([2048] * 8, 16, 132) == 128


def test_pieces_stay_on_the_grids_z_axis():
    """65 500 one-tile sequences and a long one: the cut the model scores best (96 tiles) puts
    65 605 pieces on the grid's z axis, more than ``MAX_SEQS``, so a coarser one is taken."""
    lengths = [16] * 65500 + [16 * 10000]
    tiles = [-(-n // 16) for n in lengths]
    piece = cp_plan.fused_piece_tiles(lengths, 1, 132)
    assert sum(cp_plan.piece_counts(tiles, 96)) > MAX_SEQS >= sum(cp_plan.piece_counts(tiles, piece))
    best = cp_plan.makespan_us(cp_plan.piece_items(lengths, 1, 96), 132)
    assert best < cp_plan.makespan_us(cp_plan.piece_items(lengths, 1, piece), 132)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
    heads=st.integers(1, 96),
    sms=st.sampled_from([78, 114, 132]),
)
def test_plans_are_tile_aligned_covers_and_never_slower_than_no_cut(lengths, heads, sms):
    piece = cp_plan.fused_piece_tiles(lengths, heads, sms)
    longest = max(-(-n // 16) for n in lengths)
    assert 1 <= piece <= max(longest, 1)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    pieces = cp_plan.fused_pieces(cp_plan.sequences(1, 0, cu), piece)
    for (first, length, _), seq in zip(cp_plan.sequences(1, 0, cu), pieces):
        assert seq[0].first_token == first and sum(p.num_tokens for p in seq) == length
        assert all(p.num_tokens % 16 == 0 for p in seq[:-1]) and all(p.num_tokens <= piece * 16 for p in seq)
    # The whole sequence is a candidate, so the pick's modelled time is never worse than no cut.
    chosen = cp_plan.makespan_us(cp_plan.piece_items(lengths, heads, piece), sms)
    assert chosen <= cp_plan.makespan_us(cp_plan.piece_items(lengths, heads, longest), sms) + 1e-9
