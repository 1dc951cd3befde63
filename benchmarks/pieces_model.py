"""What a fused prefill over certified pieces would take, from the fused kernel's measured rates
(docs/DESIGN.md, Certified truncation; no GPU needed):

    python -m benchmarks.pieces_model [--json docs/bench/prefill_vs_cudnn.json]

Each (sequence, head) chain is cut into pieces of about ``piece`` tiles; every piece but a
sequence's first also runs ``warmup`` tiles before its own from a zero state.  Items (piece,
head) go longest first onto ``sms`` SMs, one CTA per SM at a time, each costing ``item_us`` plus
``tile_us`` per tile (the fused kernel: 1.45 µs a tile, ~9 µs per item, PERFORMANCE "K1 alone and
the fused kernel's timeline").  The makespan of the best piece length per row is printed beside
cuDNN's standard-regime time from a ``bench_cudnn`` run.
"""

import argparse
import heapq
import json
import math
from pathlib import Path

from benchmarks.bench_cudnn import ROWS

TILE = 16
SMS = 132
TILE_US = 1.45
ITEM_US = 9.0
WARMUP = 3
MIN_PIECE = 8


def piece_items(lengths, heads: int, piece: int, warmup: int = WARMUP) -> list:
    """Tiles each item runs (its warm-up included) when every sequence is cut into equal pieces
    of at most ``piece`` tiles."""
    items = []
    for tokens in lengths:
        tiles = math.ceil(tokens / TILE)
        count = math.ceil(tiles / piece)
        size = math.ceil(tiles / count)
        for i in range(count):
            own = min(size, tiles - i * size)
            items += [own + (warmup if i > 0 else 0)] * heads
    return items


def makespan_us(items, sms: int = SMS, tile_us: float = TILE_US, item_us: float = ITEM_US) -> float:
    """Longest-first list scheduling of ``items`` (tiles each) onto ``sms`` SMs."""
    finish = [0.0] * sms
    for tiles in sorted(items, reverse=True):
        heapq.heapreplace(finish, finish[0] + item_us + tiles * tile_us)
    return max(finish)


def best_piece(lengths, heads: int, **kw) -> tuple:
    """(makespan µs, piece tiles, items) of the best piece length from MIN_PIECE tiles up."""
    longest = max(math.ceil(n / TILE) for n in lengths)
    best = None
    for piece in range(MIN_PIECE, max(longest, MIN_PIECE) + 1):
        items = piece_items(lengths, heads, piece)
        candidate = (makespan_us(items, **kw), piece, len(items))
        best = candidate if best is None else min(best, candidate)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="docs/bench/prefill_vs_cudnn.json", help="a bench_cudnn results file")
    args = p.parse_args(argv)
    cudnn = {
        r["row"]: r.get("cudnn_fp32_graph_ms")
        for r in json.loads(Path(args.json).read_text())["rows"]
        if r.get("regime") == "standard"
    }
    print("| row | piece (tiles) | items | model µs | cuDNN µs | cuDNN ÷ model |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (heads, lengths) in ROWS.items():
        us, piece, items = best_piece(lengths, heads)
        theirs = cudnn.get(name)
        ratio = f"{theirs * 1e3 / us:.2f}" if theirs else "–"
        print(f"| {name} | {piece} | {items} | {us:.1f} | {theirs * 1e3 if theirs else float('nan'):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
