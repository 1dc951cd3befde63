import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cula_aot.layout import (
    CHUNK,
    D,
    IMAGE_BYTES,
    checkpoint_schedule,
    checkpoint_tiles,
    decode_k_inter,
    fixed_total_slots,
    k_inter_index,
    varlen_slot_base,
    varlen_total_slots,
)


def test_k_inter_formula_matches_spec_bytes():
    # CONTRACT §3: element (r, c) at byte 2·((c//8)·128 + r·8 + c%8).
    for r, c in [(0, 0), (1, 0), (0, 1), (15, 7), (0, 8), (3, 77), (15, 127)]:
        assert 2 * k_inter_index(r, c) == 2 * ((c // 8) * 128 + r * 8 + c % 8)
    indices = {k_inter_index(r, c) for r in range(CHUNK) for c in range(D)}
    assert indices == set(range(CHUNK * D)) and IMAGE_BYTES == 4096


def test_decode_inverts_encode():
    logical = torch.randn(3, CHUNK, D)
    image = torch.empty(3, CHUNK * D)
    for r in range(CHUNK):
        for c in range(D):
            image[:, k_inter_index(r, c)] = logical[:, r, c]
    assert torch.equal(decode_k_inter(image), logical)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=30))
def test_varlen_slot_ranges_are_disjoint_and_bounded(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = varlen_total_slots(cu[-1], len(lengths))
    end = 0
    for s, n in enumerate(lengths):
        first = varlen_slot_base(cu, s)
        assert first >= end, "a sequence's tiles overlap the previous sequence's"
        end = first + -(-n // CHUNK)
    assert end <= total == varlen_slot_base(cu, len(lengths))


def test_fixed_slots():
    assert fixed_total_slots(2, 17) == 4 and fixed_total_slots(1, 16) == 1 and fixed_total_slots(3, 1) == 3


@settings(max_examples=300, deadline=None)
@given(
    length=st.integers(1, 700),
    offset_blocks=st.integers(0, 200),
    before_tiles=st.integers(0, 60),
    every_tiles=st.integers(1, 20),
    columns=st.integers(1, 40),
)
def test_checkpoint_tiles_are_the_multiples_of_every(length, offset_blocks, before_tiles, every_tiles, columns):
    """Brute force: a checkpoint after every whole tile whose end is a position (from the request
    start) that is a multiple of ``every``; columns count this call's checkpoints from 0."""
    offset, before, every = 16 * offset_blocks, 16 * before_tiles, 16 * every_tiles
    want, column = [], 0
    for p in range(1, before + length + 1):  # tokens of the call's part of the sequence
        if (offset + p) % every == 0:
            if p > before and (p - before) % 16 == 0 and column < columns:
                want.append(((p - before) // 16 - 1, column))
            column += 1
    assert checkpoint_tiles(length, offset, before, every, columns) == want


@pytest.mark.parametrize("offset", [-16, 8, 17])
def test_misaligned_checkpoint_offsets_have_no_schedule(offset):
    assert checkpoint_schedule(offset, 0, 64) is None
    assert checkpoint_tiles(500, offset, 0, 64, 10) == []
