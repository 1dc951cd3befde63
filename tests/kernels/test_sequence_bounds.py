"""The kernels' bound on device cu_seqlens values (``kernels.common.sequence_bounds``,
``slot_base``, K1's tile cursor, ``varlen_sequence``'s malformed test), emulated on the CPU for
any int32 values: every tile a kernel touches stays inside the tensors and its slots, and a
well-formed cu_seqlens maps exactly as before (CPU only; the GPU fuzz runs the kernels)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from cula_aot.layout import CHUNK, varlen_total_slots

INT32 = st.integers(-(2**31), 2**31 - 1)


def start_of(cu, s, total):
    return max(min(cu[s], total), 0)


def bounds(cu, s, total):
    start = start_of(cu, s, total)
    return start, max(min(cu[s + 1], total), start)


def slot_base(cu, s, total):
    return (start_of(cu, s, total) + (CHUNK - 1) * s) // CHUNK


def first_sequence(cu, n, slot, total):
    """``varlen_slot_sequence``: the binary search (any values give an index in [0, n))."""
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if slot_base(cu, mid, total) <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


def k1_tiles(cu, total, first_slot, count):
    """K1's producer cursor over one CTA's slots: [(slot, sequence, first token, rows)]."""
    n = len(cu) - 1
    seq = first_sequence(cu, n, first_slot, total)
    base, next_base = slot_base(cu, seq, total), slot_base(cu, seq + 1, total)
    tiles = []
    for slot in range(first_slot, first_slot + count):
        while slot >= next_base and seq < n - 1:
            seq += 1
            base, next_base = next_base, slot_base(cu, seq + 1, total)
        start, end = bounds(cu, seq, total)
        token0 = start + (slot - base) * CHUNK
        tiles.append((slot, seq, token0, min(end - token0, CHUNK)))
    return tiles


def malformed_by_sequence(cu, total):
    """``varlen_sequence``'s flag, ORed over the sequences (each K2 / fused CTA checks its own)."""
    flags = []
    for s in range(len(cu) - 1):
        start, end = bounds(cu, s, total)
        flags.append(start != cu[s] or end != cu[s + 1] or (s == 0 and start != 0))
    return any(flags)


def malformed(cu, total):
    return cu[0] != 0 or any(not 0 <= c <= total for c in cu) or any(b < a for a, b in zip(cu, cu[1:]))


@settings(max_examples=400, deadline=None)
@given(
    total=st.integers(1, 5000),
    cu=st.lists(st.one_of(INT32, st.integers(-40, 5040)), min_size=2, max_size=9),
    tiles_per_cta=st.integers(1, 8),
)
def test_any_values_stay_inside_the_tensors_and_slots(total, cu, tiles_per_cta):
    n = len(cu) - 1
    total_slots = varlen_total_slots(total, n)
    for s in range(n):  # K2 / fused: a sequence's tokens and record slots
        start, end = bounds(cu, s, total)
        assert 0 <= start <= end <= total
        assert slot_base(cu, s, total) + -(-(end - start) // CHUNK) <= total_slots
    for first in range(0, total_slots, tiles_per_cta):  # K1: every CTA's tiles
        for _slot, seq, token0, rows in k1_tiles(cu, total, first, min(tiles_per_cta, total_slots - first)):
            assert 0 <= seq < n
            assert 0 <= token0 < 2**31
            if rows > 0:
                assert token0 + rows <= total
    assert malformed_by_sequence(cu, total) == malformed(cu, total)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    pad=st.integers(0, 40),
    tiles_per_cta=st.integers(1, 8),
)
def test_well_formed_values_map_as_before(lengths, pad, tiles_per_cta):
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    total = cu[-1] + pad  # rows past the last sequence are unused, not malformed
    if total == 0:
        return
    n = len(lengths)
    total_slots = varlen_total_slots(total, n)
    expected = {}
    for s, length in enumerate(lengths):
        first = (cu[s] + (CHUNK - 1) * s) // CHUNK
        for j in range(-(-length // CHUNK)):
            expected[first + j] = (s, cu[s] + CHUNK * j, min(length - CHUNK * j, CHUNK))
    for first in range(0, total_slots, tiles_per_cta):
        for slot, seq, token0, rows in k1_tiles(cu, total, first, min(tiles_per_cta, total_slots - first)):
            if slot in expected:
                assert (seq, token0, rows) == expected[slot]
            else:
                assert rows <= 0  # a gap slot
    assert not malformed_by_sequence(cu, total)
