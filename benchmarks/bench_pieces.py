#!/usr/bin/env python3
"""Where the time of ``intracard_cp="truncated"`` goes, on both of its paths:

    python3 -m benchmarks.bench_pieces --cudnn-path DIR --cuda-headers DIR --json docs/bench/pieces.json

For each row (``bench_cudnn``'s names, its inputs, one regime): graph replay (25 warm-up, 100
timed, interquartile mean) and the CUPTI median of each kernel of ``intracard_cp="auto"``; of the
fused pieces at the planner's piece length and at each ``--piece-scale`` multiple of it
(``paths._cached_piece_tiles`` overridden: is the planner's pick the fastest?); of the walking path
(the ``fused=False`` override: K1, the tile bounds, the walking K2) at each ``cp_plan.PIECE_WAVES``
in ``--waves``; and cuDNN's fp32-gate kernel, all in the same process.
"""

import argparse
import json
import re
from pathlib import Path

import torch

from benchmarks import bench_cudnn
from benchmarks.timing import capture_graph, kernel_medians_us, time_cuda
from cula_aot.ops import cp_plan, paths
from cula_aot.ops.plan_cache import PLANS
from cula_aot.specs import K2_SEGMENTED_V_BLOCK
from cula_aot.testing import HEAD_DIM as D

DEFAULT_ROWS = "h4-1x1024,h12-1x2048,h12-1x4096,h12-4x2048,h16-1x8192,h24-1x8192,h64-1x8192,h8-1x16384,h3-1x32768"
CUTE_NAME = re.compile(r"kernel_cutlass_(\w+?)_kernel")


def graph_ms(fn) -> float:
    graph = capture_graph(fn)
    try:
        return time_cuda(graph.replay)
    finally:
        del graph


def kernel_split_us(fn) -> dict:
    """CUPTI median µs per kernel of one call of ``fn``, by the kernel's class name (``k1_prepare``,
    ``tile_bound``, ``k2_recurrence``, ...)."""
    split = {}
    for name, us in kernel_medians_us(fn).items():
        match = CUTE_NAME.match(name)
        label = match.group(1) if match else name[:40]
        split[label] = split.get(label, 0.0) + us
    return split


def measure(name, regime, waves, scales, cudnn_plan) -> dict:
    heads, lengths = bench_cudnn.ROWS[name]
    x = bench_cudnn.draw_inputs(heads, lengths, regime, "cuda", seed=0)
    row = {"row": name, "regime": regime, "H": heads, "lengths": lengths}
    auto = bench_cudnn.ours_runner(x)
    row["auto_graph_ms"] = graph_ms(auto)
    row["auto_kernels_us"] = kernel_split_us(auto)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    planned = cp_plan.fused_piece_tiles(lengths, heads, sms)
    row["fused_pieces"], row["walking"] = [], []
    default_waves, default_tiles = cp_plan.PIECE_WAVES, paths._cached_piece_tiles
    try:
        for scale in scales:
            tiles = max(1, round(planned * scale))
            paths._cached_piece_tiles = lambda lengths, heads, sms, tiles=tiles: tiles
            PLANS.clear()  # a cached plan keeps the pieces it was built with
            run = bench_cudnn.ours_runner(x, "truncated")
            run()
            row["fused_pieces"].append(
                {"scale": scale, "piece_tiles": tiles, "graph_ms": graph_ms(run), "kernels_us": kernel_split_us(run)}
            )
        paths._cached_piece_tiles = default_tiles
        for w in waves:
            cp_plan.PIECE_WAVES = w
            PLANS.clear()
            run = bench_cudnn.ours_runner(x, "truncated", fused=False)
            run()
            row["walking"].append(
                {
                    "waves": w,
                    "split": cp_plan.pieces_split(len(lengths), heads, sms, D // K2_SEGMENTED_V_BLOCK),
                    "graph_ms": graph_ms(run),
                    "kernels_us": kernel_split_us(run),
                }
            )
    finally:
        cp_plan.PIECE_WAVES, paths._cached_piece_tiles = default_waves, default_tiles
        PLANS.clear()
    if cudnn_plan is not None:
        row["cudnn_fp32_graph_ms"] = graph_ms(bench_cudnn.cudnn_runner(x, cudnn_plan, fp32_gate=True))
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma list of bench_cudnn rows")
    p.add_argument("--regime", default="standard", choices=bench_cudnn.REGIMES)
    p.add_argument("--waves", default="2", help="comma list of cp_plan.PIECE_WAVES values (the walking path)")
    p.add_argument("--piece-scale", default="1,0.5,2", help="comma list of multiples of the planned piece length")
    p.add_argument("--cudnn-path", default=None, help="cuDNN frontend install dir (omit: no cuDNN column)")
    p.add_argument("--cuda-headers", action="append", default=[], help="extra CUDA tree for cuDNN's NVRTC")
    p.add_argument("--json", help="results file")
    args = p.parse_args(argv)
    plan = None
    if args.cudnn_path:
        bench_cudnn.find_cuda_headers(args.cuda_headers)
        module, reason = bench_cudnn.load_cudnn(args.cudnn_path)
        plan = bench_cudnn.DEFAULT_PLAN if module is not None else None
        if module is None:
            print(f"[cudnn] {reason}")
    waves = [int(w) for w in args.waves.split(",") if w]
    scales = [float(f) for f in args.piece_scale.split(",") if f]
    results = {"device": torch.cuda.get_device_name(), "regime": args.regime, "rows": []}
    for name in args.rows.split(","):
        row = measure(name, args.regime, waves, scales, plan)
        results["rows"].append(row)
        pieces = " ".join(
            f"{label}{p[key]}:{p['graph_ms']:.4f}({'/'.join(f'{v:.1f}' for v in p['kernels_us'].values())})"
            for label, key, runs in (("x", "scale", row["fused_pieces"]), ("w", "waves", row["walking"]))
            for p in runs
        )
        print(
            f"{name} auto {row['auto_graph_ms']:.4f} {row['auto_kernels_us']} | {pieces} | "
            f"cuDNN fp32 {row.get('cudnn_fp32_graph_ms', float('nan')):.4f}",
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
