"""The fused pieces' planner (``cula_aot.ops.cp_plan.fused_piece_tiles``) on every ``bench_cudnn``
row: the piece length it picks, the items, its makespan model at the fused kernel's measured rates,
beside cuDNN's standard-regime time from a ``bench_cudnn`` run (no GPU needed):

    python -m benchmarks.pieces_model [--json docs/bench/prefill_vs_cudnn.json] [--sms 132]

``--measured docs/bench/pieces.json`` instead replays a ``bench_pieces`` run's piece lengths with
the kernel's certificate on each row's standard inputs (drawn on the CPU; a GPU draw differs, so
which positions miss differs, not how many): an item whose warm-up does not certify waits for its
predecessor's end, as the kernel does.  Printed beside the measured kernel µs: the makespan with
those waits at 2 and at 3 warm-up tiles, and with every piece certified.
"""

import argparse
import heapq
import json
from pathlib import Path

from benchmarks.bench_cudnn import ROWS, draw_inputs
from cula_aot import reference
from cula_aot.layout import FLAG_FINAL_STATE, FLAG_INITIAL_STATE, SEG_PREDECESSOR, SEG_SEQ, SEG_SEQ_OFFSET, SEG_TOKENS
from cula_aot.ops import cp_plan, prefill_plans
from cula_aot.specs import TILE_BOUND_MARGIN_LOG2


def tile_bounds(x):
    """The kernel's per-tile bound (log2 ‖A‖_F plus its margin), ``[tiles, H]``, and each
    sequence's first tile (its tiles follow the sequences in order)."""
    tiles = reference.prepare_tiles(
        x["q"], x["k"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
        lower_bound=x["lower_bound"], cu_seqlens=x["cu_cpu"], gate_kind="safe",
    )  # fmt: skip
    counts = [-(-n // reference.CHUNK) for n in x["lengths"]]
    return reference.tile_frobenius_bound(tiles) + TILE_BOUND_MARGIN_LOG2, [sum(counts[:n]) for n in range(len(counts))]


def makespan_with_waits(rows, bounds, tile_first: list, heads: int, warmup: int, sms: int) -> float:
    """µs until the last (row, head) item ends, items dealt in ticket order to whichever of ``sms``
    SMs frees first (one CTA each, ``cp_plan``'s rates); an item whose ``warmup`` tiles' bounds
    sum above ``TRUNCATION_LOG2`` starts its own tiles when its predecessor has ended."""
    free = [0.0] * sms
    ends, last = {}, 0.0
    for r, row in enumerate(rows):
        first = tile_first[row[SEG_SEQ]]
        c0 = row[SEG_SEQ_OFFSET] // reference.CHUNK
        c1 = -(-(row[SEG_SEQ_OFFSET] + row[SEG_TOKENS]) // reference.CHUNK)
        w = min(warmup, c0)
        for h in range(heads):
            t = heapq.heappop(free) + cp_plan.FUSED_ITEM_US + w * cp_plan.FUSED_TILE_US
            if w < c0 and float(bounds[first + c0 - w : first + c0, h].sum()) > reference.TRUNCATION_LOG2:
                t = max(t, ends[(row[SEG_PREDECESSOR], h)])
            t += (c1 - c0) * cp_plan.FUSED_TILE_US
            ends[(r, h)] = t
            heapq.heappush(free, t)
            last = max(last, t)
    return last


def measured(path: str, sms: int):
    print("| row | piece (tiles) | measured µs | waits, 2 warm-up tiles | waits, 3 | all certified |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in json.loads(Path(path).read_text())["rows"]:
        heads = row["H"]
        x = draw_inputs(heads, row["lengths"], "standard", "cpu")
        bounds, tile_first = tile_bounds(x)
        seqs = cp_plan.sequences(1, 0, x["cu_cpu"].tolist())
        for run in row["fused_pieces"]:
            pieces = cp_plan.fused_pieces(seqs, run["piece_tiles"])
            table = prefill_plans._fused_piece_rows(pieces, FLAG_INITIAL_STATE, FLAG_FINAL_STATE)
            spans = [makespan_with_waits(table, b, tile_first, heads, w, sms) for b, w in
                     ((bounds, 2), (bounds, 3), (bounds - 1e9, 2))]  # fmt: skip
            kernel = run["kernels_us"].get("fused_pieces")
            cells = " | ".join(f"{s:.0f}" for s in spans)
            print(f"| {row['row']} | {run['piece_tiles']} | {kernel:.0f} | {cells} |", flush=True)


def planned(path: str, sms: int):
    cudnn = {
        r["row"]: r.get("cudnn_fp32_graph_ms")
        for r in json.loads(Path(path).read_text())["rows"]
        if r.get("regime") == "standard"
    }
    print("| row | piece (tiles) | items | model µs | cuDNN µs | cuDNN ÷ model |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (heads, lengths) in ROWS.items():
        piece = cp_plan.fused_piece_tiles(lengths, heads, sms)
        items = cp_plan.piece_items(lengths, heads, piece)
        us = cp_plan.makespan_us(items, sms)
        theirs = cudnn.get(name)
        ratio = f"{theirs * 1e3 / us:.2f}" if theirs else "–"
        shown = f"{theirs * 1e3:.1f}" if theirs else "–"
        print(f"| {name} | {piece} | {len(items)} | {us:.1f} | {shown} | {ratio} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="docs/bench/prefill_vs_cudnn.json", help="a bench_cudnn results file")
    p.add_argument("--measured", metavar="JSON", help="a bench_pieces results file: replay it with waits")
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args(argv)
    if args.measured:
        measured(args.measured, args.sms)
    else:
        planned(args.json, args.sms)


if __name__ == "__main__":
    main()
