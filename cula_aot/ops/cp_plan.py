"""Intracard context-parallel planning (pure Python, no GPU): whether and how to split sequences.

A plan cuts each sequence into segments of whole 16-token tiles (the last may be partial), in
order, never across a sequence boundary.  ``auto_split`` chooses the split from the sequence
lengths, H and the SM count with the cost model below; ``plan`` lays out the segments.

Cost model, in units of one K2 tile step of one CTA (≈ 0.9 µs on an H200 with the tensor-core K2).  With t_i the
tiles of sequence i, W = Σ t_i · H · V-blocks (CTA tile steps of work), C = SMs · CTAS_PER_SM
(CTAs that run at full per-CTA speed), k_i = the segments of sequence i, P = max ⌈t_i / k_i⌉
(the longest chain) and f = the share of tiles in non-last segments:

    serial = max(max t_i, W / C)
    cp(s)  = max(P, 2·f·W / C) + MERGE_STEP · max k_i + max(P, W / C) + OVERHEAD

(pre_scan: two chains per non-last segment; merge: one step per segment; the segmented K2
re-runs every tile from its merged carry; OVERHEAD: two more launches plus host table work
that the GPU waits on; fitted when a sequence's first segment also took two pre_scan chains
and a merge product, where it now takes one chain and no product, which the model does not
credit).  ``auto_split`` returns the s ∈ SPLITS with the lowest cost, or 1 when CP does not
beat serial by MIN_GAIN.  Constants: first fitted to 30 timings (6 CONTRACT §7 CP workloads
× serial and s_split 2/4/8/16, H200, 2026-11-29; tile step 0.90 µs), then CTAS_PER_SM and
MERGE_STEP refitted to the 15 auto-CP graph timings of 2026-12-01 (CONTRACT §7 rows and long
contexts, the five-CTA segmented K2): every CONTRACT §7 pick stays the measured best, and the worst
long-context loss against the best split, 23% before, measured 3.7% after (docs/PERFORMANCE.md,
Intracard CP).  OVERHEAD last refitted (120 → 25) with single 1k–4k prompts at 1–64 heads and the
production shards' forced splits (H200, 2026-12-05): at 120 the planner kept 2048-token prompts
serial that CP runs up to 1.7× faster; anywhere in 15–35 every measured pick is the fastest split
(worst 1.003 over 48 rows).  ``python -m benchmarks.fit_cp_plan RUN.json ...`` scores them, and a
grid of others, against a benchmark run's forced splits.
"""

import dataclasses
import heapq

from ..layout import CHUNK, MAX_SEQS, fixed_total_slots, varlen_slot_base
from ..specs import K2_CTAS_PER_SM, PIECE_WARMUP_TILES

SPLITS = (1, 2, 4, 8, 16, 32, 64)
MIN_SEGMENT_TILES = 8  # shorter segments cost more in pre_scan/merge than they save
CTAS_PER_SM = 2.5
MERGE_STEP = 4.0
OVERHEAD = 25.0
MIN_GAIN = 1.05


@dataclasses.dataclass(frozen=True)
class Segment:
    seq: int
    first_token: int  # absolute token index on the flattened B·T axis
    num_tokens: int
    first_slot: int  # K1 tile slot of the segment's first tile


def sequences(batch: int, seq_len: int, cu_seqlens_host):
    """(first token, length, first tile slot) of every sequence, fixed or varlen."""
    if cu_seqlens_host is None:
        per_seq = fixed_total_slots(1, seq_len)
        return [(b * seq_len, seq_len, b * per_seq) for b in range(batch)]
    cu = list(cu_seqlens_host)
    return [(cu[s], cu[s + 1] - cu[s], varlen_slot_base(cu, s)) for s in range(len(cu) - 1)]


def plan(seqs, s_split: int) -> list[list[Segment]]:
    """Cut every sequence into at most ``s_split`` tile-aligned segments of ≥ MIN_SEGMENT_TILES
    tiles (a sequence too short to split stays whole)."""
    if s_split < 1:
        raise ValueError(f"s_split must be >= 1, got {s_split}")
    out = []
    for seq, (first_token, length, first_slot) in enumerate(seqs):
        parts = max(1, min(s_split, -(-length // CHUNK) // MIN_SEGMENT_TILES))
        out.append(_equal_cuts(seq, first_token, length, first_slot, parts))
    return out


def _equal_cuts(seq: int, first_token: int, length: int, first_slot: int, parts: int) -> list[Segment]:
    """Sequence ``seq`` cut into ``parts`` tile-aligned segments of ⌈tiles / parts⌉ tiles (fewer
    where they run out; the last one's last tile partial); none for an empty sequence."""
    tiles = -(-length // CHUNK)
    per = -(-tiles // parts)
    segs, tile = [], 0
    while tile < tiles:
        n = min(per, tiles - tile)
        tokens = min(n * CHUNK, length - tile * CHUNK)
        segs.append(Segment(seq, first_token + tile * CHUNK, tokens, first_slot + tile))
        tile += n
    return segs


def cost(lengths, heads: int, sm_count: int, s_split: int, v_blocks: int) -> float:
    tiles = [-(-n // CHUNK) for n in lengths]
    work = sum(tiles) * heads * v_blocks
    capacity = sm_count * CTAS_PER_SM
    if s_split == 1:
        return max(max(tiles), work / capacity)
    parts = [max(1, min(s_split, t // MIN_SEGMENT_TILES)) for t in tiles]
    path = max(-(-t // k) for t, k in zip(tiles, parts))
    split_share = sum(t * (k - 1) / k for t, k in zip(tiles, parts)) / sum(tiles)
    return (
        max(path, 2 * split_share * work / capacity) + MERGE_STEP * max(parts) + max(path, work / capacity) + OVERHEAD
    )


def auto_split(lengths, heads: int, sm_count: int, v_blocks: int) -> int:
    """The split the cost model prefers (1 = serial); deterministic, short inputs stay serial."""
    serial = cost(lengths, heads, sm_count, 1, v_blocks)
    # Every split costs at least OVERHEAD + MERGE_STEP + work / capacity (its terms' minima), so
    # when that cannot beat serial by MIN_GAIN the search is skipped: the same answer in O(N)
    # for the many-short-sequence batches of serving prefill, which run this on every call.
    work = sum(-(-n // CHUNK) for n in lengths) * heads * v_blocks
    if (OVERHEAD + MERGE_STEP + work / (sm_count * CTAS_PER_SM)) * MIN_GAIN > serial:
        return 1
    best, best_cost = 1, serial
    for s in SPLITS[1:]:
        c = cost(lengths, heads, sm_count, s, v_blocks)
        if c < best_cost:
            best, best_cost = s, c
    return best if best_cost * MIN_GAIN <= serial else 1


# Certified-truncation pieces (``intracard_cp="truncated"``): enough per chain for about two waves of
# segmented K2 CTAs (K2_CTAS_PER_SM per SM, ``v_blocks`` per piece and head).
PIECE_WAVES = 2


def pieces_split(num_seqs: int, heads: int, sm_count: int, v_blocks: int) -> int:
    """Pieces per chain for ``intracard_cp="truncated"`` (at least 2; ``plan`` keeps each piece
    at ≥ MIN_SEGMENT_TILES tiles)."""
    return max(2, PIECE_WAVES * K2_CTAS_PER_SM * sm_count // (v_blocks * heads * max(num_seqs, 1)))


# The fused pieces (``intracard_cp="truncated"`` on the fused kernel): every sequence cut into
# equal pieces of about ``fused_piece_tiles`` tiles, each (piece, head) one CTA of the fused
# kernel.  The piece length is the one whose items, dealt in launch order onto one CTA per SM,
# finish first at the fused kernel's rates: a tile per FUSED_TILE_US and FUSED_ITEM_US per item
# (PERFORMANCE.md, K1 alone and the fused kernel's timeline).  Candidates: the whole sequence,
# and the lengths that make 1 .. FUSED_PIECE_WAVES waves of items.
FUSED_TILE_US = 1.45
FUSED_ITEM_US = 9.0
FUSED_PIECE_MIN_TILES = 8
FUSED_PIECE_WAVES = 8


def piece_counts(tiles: list[int], piece: int) -> list[int]:
    """Pieces per sequence (tile counts ``tiles``) for pieces of at most ``piece`` tiles."""
    return [max(1, -(-t // piece)) for t in tiles]


def piece_order(counts: list[int]) -> list[tuple[int, int]]:
    """The fused pieces' launch order of (sequence, piece index), sequence s cut into counts[s]:
    the pieces with a successor first, then each sequence's last; piece index first within each
    (a predecessor always comes before its successor)."""
    pieces = [(n, s) for s, count in enumerate(counts) for n in range(count)]
    order = sorted(pieces, key=lambda p: (p[0] + 1 == counts[p[1]], p[0], p[1]))
    return [(s, n) for n, s in order]


def piece_items(lengths, heads: int, piece: int, warmup: int = PIECE_WARMUP_TILES) -> list[int]:
    """The tiles each (piece, head) item runs, warm-up included, in the fused pieces' launch order
    (``piece_order``)."""
    tiles = [-(-n // CHUNK) for n in lengths]
    counts = piece_counts(tiles, piece)
    sizes = [-(-t // count) for t, count in zip(tiles, counts)]
    runs = []
    for s, n in piece_order(counts):
        own = min(sizes[s], tiles[s] - n * sizes[s])
        runs += [own + min(warmup, n * sizes[s])] * heads
    return runs


def makespan_us(items, sms: int, tile_us: float = FUSED_TILE_US, item_us: float = FUSED_ITEM_US) -> float:
    """When ``items`` (tiles each), dealt in order to whichever of ``sms`` SMs frees first, finish."""
    finish = [0.0] * sms
    for tiles in items:
        heapq.heapreplace(finish, finish[0] + item_us + tiles * tile_us)
    return max(finish)


def fused_piece_tiles(lengths, heads: int, sm_count: int) -> int:
    """The piece length (tiles) the makespan model prefers, the longer of equals, among those that
    keep the pieces on the grid's z axis (``MAX_SEQS``; whole sequences always do)."""
    tiles = [-(-n // CHUNK) for n in lengths]
    longest, work = max(max(tiles), 1), sum(tiles) * heads
    candidates = {longest}
    for waves in range(1, FUSED_PIECE_WAVES + 1):
        candidates.add(min(longest, max(FUSED_PIECE_MIN_TILES, -(-work // (waves * sm_count)))))
    scored = [
        (makespan_us(piece_items(lengths, heads, p), sm_count), -p)
        for p in candidates
        if p == longest or sum(piece_counts(tiles, p)) <= MAX_SEQS
    ]
    return -min(scored)[1]


def fused_pieces(seqs, piece_tiles: int) -> list[list[Segment]]:
    """Every sequence (``sequences``) cut into equal tile-aligned pieces of at most
    ``piece_tiles`` tiles (the last may be shorter, its last tile partial); an empty sequence is
    one empty piece (it still writes its final state)."""
    return [
        _equal_cuts(seq, first_token, length, first_slot, -(-length // CHUNK // piece_tiles) or 1)
        or [Segment(seq, first_token, 0, first_slot)]
        for seq, (first_token, length, first_slot) in enumerate(seqs)
    ]
