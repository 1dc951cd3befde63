"""Intracard CP planner properties (CPU only)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from cula_aot.layout import (
    CHUNK,
    FLAG_FINAL_STATE,
    FLAG_IDENTITY_INIT,
    FLAG_INDEXED_INIT,
    FLAG_INITIAL_STATE,
    FLAG_NO_OUTPUT,
    FLAG_ZERO_V,
    SEG_FIRST_TOKEN,
    SEG_SEQ,
    SEG_SEQ_OFFSET,
    varlen_slot_base,
)
from cula_aot.ops import cp_plan
from cula_aot.ops.prefill_plans import _segment_tables, prescan_jobs


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=12), st.integers(1, 70))
def test_segments_cover_each_sequence_once_in_order(lengths, s_split):
    cu = _cu(lengths)
    plan = cp_plan.plan(cp_plan.sequences(1, cu[-1], cu), s_split)
    assert len(plan) == len(lengths)
    for seq, segs in enumerate(plan):
        assert 1 <= len(segs) <= s_split
        token, slot = cu[seq], varlen_slot_base(cu, seq)
        for n, seg in enumerate(segs):
            assert seg.seq == seq and seg.first_token == token and seg.first_slot == slot
            assert seg.num_tokens > 0
            if n + 1 < len(segs):
                # Only a sequence's last segment may hold a partial tile.
                assert seg.num_tokens % CHUNK == 0 and seg.num_tokens >= cp_plan.MIN_SEGMENT_TILES * CHUNK
            token += seg.num_tokens
            slot += -(-seg.num_tokens // CHUNK)
        assert token == cu[seq + 1], "segments must end exactly at the sequence end"


@given(st.integers(1, 4), st.integers(1, 9000), st.integers(1, 16))
def test_fixed_batches_split_per_row(batch, seq_len, s_split):
    plan = cp_plan.plan(cp_plan.sequences(batch, seq_len, None), s_split)
    per_seq = -(-seq_len // CHUNK)
    for b, segs in enumerate(plan):
        assert segs[0].first_token == b * seq_len and segs[0].first_slot == b * per_seq
        assert sum(s.num_tokens for s in segs) == seq_len


def test_auto_takes_the_measured_fastest_split_of_short_prompts():
    # Forced splits of single prompts, graph replay, H200 2026-12-05 (docs/PERFORMANCE.md, CP
    # planner sweep): the fastest of serial and s = 2..32 on each row.
    for heads, length, fastest in (
        (4, 2048, 8),
        (8, 2048, 8),
        (12, 1024, 1),
        (12, 2048, 4),
        (16, 2048, 4),
        (24, 2048, 1),
        (64, 2048, 1),
        (12, 4096, 8),
        (24, 8192, 4),
        (32, 8192, 1),
    ):
        assert cp_plan.auto_split([length], heads, 132, 4) == fastest, (heads, length)


def test_auto_declines_short_and_busy_inputs():
    assert cp_plan.auto_split([100, 300], heads=4, sm_count=132, v_blocks=8) == 1
    assert cp_plan.auto_split([8192] * 8, heads=64, sm_count=132, v_blocks=8) == 1
    assert cp_plan.auto_split([8192], heads=4, sm_count=132, v_blocks=8) > 1
    assert cp_plan.auto_split([16384], heads=8, sm_count=132, v_blocks=8) > 1


@given(st.lists(st.integers(1, 20000), min_size=1, max_size=8), st.sampled_from([1, 2, 4, 8, 64]))
def test_auto_is_deterministic_and_a_listed_split(lengths, heads):
    a = cp_plan.auto_split(lengths, heads, 132, 8)
    assert a == cp_plan.auto_split(lengths, heads, 132, 8) and a in cp_plan.SPLITS


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(1, 40000), min_size=1, max_size=40),
    st.sampled_from([1, 2, 4, 8, 16, 64, 96]),
    st.sampled_from([4, 8]),
    st.sampled_from([66, 132]),
)
def test_auto_shortcut_gives_the_full_searchs_answer(lengths, heads, v_blocks, sm_count):
    # The full search, written out: the cheapest listed split, taken only if MIN_GAIN better.
    costs = {s: cp_plan.cost(lengths, heads, sm_count, s, v_blocks) for s in cp_plan.SPLITS}
    best = min(cp_plan.SPLITS, key=lambda s: (costs[s], s))
    expected = best if costs[best] * cp_plan.MIN_GAIN <= costs[1] else 1
    assert cp_plan.auto_split(lengths, heads, sm_count, v_blocks) == expected


def test_segment_tables_link_prescan_merge_and_recurrence():
    cu = _cu([1024, 1, 300])
    plan = cp_plan.plan(cp_plan.sequences(1, cu[-1], cu), 4)
    prescan, main, bounds = _segment_tables(plan, FLAG_INITIAL_STATE | FLAG_INDEXED_INIT, FLAG_FINAL_STATE)
    assert bounds == [0, 4, 5, 7]
    # A split sequence's first segment: one job, B_0 from the user's state (its pool slot by the
    # sequence number); its middle segments two (M_i from the identity, B_i from 0); last: none.
    assert len(prescan) == prescan_jobs(plan) == (1 + 2 + 2) + 0 + 1
    assert [(row[SEG_FIRST_TOKEN], row[4], row[5]) for row in prescan] == [
        (0, 0, 1),
        (256, -1, 2),
        (256, -1, 3),
        (512, -1, 4),
        (512, -1, 5),
        (1025, 2, 11),
    ]
    first_flags = FLAG_INITIAL_STATE | FLAG_INDEXED_INIT | FLAG_NO_OUTPUT | FLAG_FINAL_STATE
    transition, end_state = (
        FLAG_IDENTITY_INIT | FLAG_ZERO_V | FLAG_NO_OUTPUT | FLAG_FINAL_STATE,
        FLAG_NO_OUTPUT | FLAG_FINAL_STATE,
    )
    assert [row[6] for row in prescan] == [first_flags] + [transition, end_state] * 2 + [first_flags]
    # Without an initial state the first job starts from 0.
    assert _segment_tables(plan, 0, FLAG_FINAL_STATE)[0][0][6] == FLAG_NO_OUTPUT | FLAG_FINAL_STATE
    for i, row in enumerate(main):
        assert row[4] == i  # every segment starts from carries[i]
    finals = [row[5] for row in main if row[6] & 2]
    assert finals == [0, 1, 2]  # only each sequence's last segment writes its final state
    # Each row's tokens of its sequence before it (where its checkpoints fall).
    starts = {row[SEG_SEQ]: row[SEG_FIRST_TOKEN] for row in reversed(main)}
    for row in prescan + main:
        assert row[SEG_SEQ_OFFSET] == row[SEG_FIRST_TOKEN] - starts[row[SEG_SEQ]]
    assert [row[SEG_SEQ_OFFSET] for row in main] == [0, 256, 512, 768, 0, 0, 160]
