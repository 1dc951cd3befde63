"""The fused pieces' planner (``cula_aot.ops.cp_plan.fused_piece_tiles``) on every ``bench_cudnn``
row: the piece length it picks, the items, its makespan model at the fused kernel's measured rates,
beside cuDNN's standard-regime time from a ``bench_cudnn`` run (no GPU needed):

    python -m benchmarks.pieces_model [--json docs/bench/prefill_vs_cudnn.json] [--sms 132]
"""

import argparse
import json
from pathlib import Path

from benchmarks.bench_cudnn import ROWS
from cula_aot.ops import cp_plan


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="docs/bench/prefill_vs_cudnn.json", help="a bench_cudnn results file")
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args(argv)
    cudnn = {
        r["row"]: r.get("cudnn_fp32_graph_ms")
        for r in json.loads(Path(args.json).read_text())["rows"]
        if r.get("regime") == "standard"
    }
    print("| row | piece (tiles) | items | model µs | cuDNN µs | cuDNN ÷ model |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (heads, lengths) in ROWS.items():
        piece = cp_plan.fused_piece_tiles(lengths, heads, args.sms)
        items = cp_plan.piece_items(lengths, heads, piece)
        us = cp_plan.makespan_us(items, args.sms)
        theirs = cudnn.get(name)
        ratio = f"{theirs * 1e3 / us:.2f}" if theirs else "–"
        shown = f"{theirs * 1e3:.1f}" if theirs else "–"
        print(f"| {name} | {piece} | {len(items)} | {us:.1f} | {shown} | {ratio} |")


if __name__ == "__main__":
    main()
