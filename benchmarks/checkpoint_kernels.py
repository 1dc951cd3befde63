#!/usr/bin/env python3
"""Where a prefix-cache checkpoint costs: per kernel (CUPTI median of 20 calls) and per graph
replay, each row run without checkpoints, with one every ``--every`` tokens, and with the same
schedule but every slot -1 (the checkpointing twin's loop without a single store), so the
twin's loop, the stores and the graph around them show apart:

    python3 -m benchmarks.checkpoint_kernels [--tag NAME] [--every 1024] [--quick]

Rows: the serial K2 chain (H4 8×1024, H32 and H64 1×8192) as a fixed-length batch and, where the
benchmark's rows take it, as varlen (another K2 cubin), and the fused kernel (H16 and H64
8×1024, and 32×256, where no sequence reaches a checkpoint at 1024: the twin alone), the ones
whose ratio was furthest from 1 in ``bench_prefill --only checkpoints``.  Serial path, initial +
final state, fp32 pool; ``--quick`` times each graph 10 + 40 instead of 25 + 100; ``--rows 5,6``
runs those rows only, ``--gate softplus`` draws and runs that gate, ``--rounds 3`` measures each
case three times in rotated order (medians), so that no case is always measured first.  One
line per row and case; ratios are to the row's plain case.

``--profile ROW`` (an index into ``ROWS``) makes one call per case and times nothing, for a
profiler: ``ncu -k regex:k2_recurrence python3 -m benchmarks.checkpoint_kernels --profile 1``.
"""

import argparse
import statistics

import torch

from benchmarks.bench_prefill import checkpoint_options, make_inputs, prefill_runner
from benchmarks.timing import capture_graph, kernel_medians_us, time_cuda

# (H, batch, length, fused, varlen): the path forced so the kernel under test runs; varlen rows are
# one batch of `batch` sequences with host lengths, as the benchmark's serving rows are.
ROWS = (
    (4, 8, 1024, False, False),
    (4, 8, 1024, False, True),
    (32, 1, 8192, False, False),
    (32, 1, 8192, False, True),
    (64, 1, 8192, False, False),
    (16, 8, 1024, True, True),
    (64, 8, 1024, True, True),
    (16, 32, 256, True, True),
)


def row_inputs(heads, batch, length, varlen, gate="safe"):
    """The inputs of a ``ROWS`` row on the GPU, drawn for ``gate``."""
    if varlen:
        return make_inputs(heads, 1, [length] * batch, None, torch.device("cuda"), gate=gate)
    return make_inputs(heads, batch, None, length, torch.device("cuda"), gate=gate)


def cases(x, every):
    """{case: checkpoint options} for inputs ``x``: none, every ``every`` tokens, and that schedule
    with no slot named (-1)."""
    written = checkpoint_options(x, every)
    skipped = {**written, "checkpoint_indices": torch.full_like(written["checkpoint_indices"], -1)}
    return {"plain": {}, f"every{every}": written, f"every{every}_skip": skipped}


def measure(runner, quick: bool) -> dict:
    """Graph replay ms and the CUPTI µs of each kernel (a short name) of one call of ``runner``."""
    graph = capture_graph(runner)
    warmup, iters = (10, 40) if quick else (25, 100)
    times = {"graph_ms": time_cuda(graph.replay, warmup=warmup, iters=iters)}
    for name, us in kernel_medians_us(runner).items():
        times[name.split("(")[0].removeprefix("kernel_")[:24]] = us
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="here", help="a label for the tree or artifacts measured")
    parser.add_argument("--every", type=int, default=1024)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", type=int, default=None, help="one call per case of ROWS[PROFILE], untimed")
    parser.add_argument("--rows", default=None, help="comma-separated indices into ROWS (default: all)")
    parser.add_argument("--gate", default="safe", choices=("safe", "softplus"))
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every case this many times, rotating their order; report medians"
    )
    args = parser.parse_args()
    if args.profile is not None:
        heads, batch, seq_len, fused, varlen = ROWS[args.profile]
        x = row_inputs(heads, batch, seq_len, varlen, args.gate)
        for options in cases(x, args.every).values():
            prefill_runner(x, intracard_cp=False, fused=fused, **options)()
        torch.cuda.synchronize()
        return
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    for heads, batch, seq_len, fused, varlen in rows:
        x = row_inputs(heads, batch, seq_len, varlen, args.gate)
        path = "fused" if fused else ("K1+K2 varlen" if varlen else "K1+K2 fixed")
        runners = {
            case: prefill_runner(x, intracard_cp=False, fused=fused, **options)
            for case, options in cases(x, args.every).items()
        }
        names = list(runners)
        samples = {case: [] for case in names}
        for r in range(args.rounds):  # each round starts one case later, so no case is always first
            for case in names[r % len(names) :] + names[: r % len(names)]:
                samples[case].append(measure(runners[case], args.quick))
        times = {
            case: {key: statistics.median(t[key] for t in samples[case]) for key in samples[case][0]} for case in names
        }
        plain = times[names[0]]
        for case in names:
            ratios = "  ".join(
                f"{key}={value:.4g} (x{value / plain[key]:.3f})" for key, value in times[case].items() if key in plain
            )
            print(f"[{args.tag}] {args.gate} H{heads} {batch}x{seq_len} {path} {case:15s} {ratios}", flush=True)
        del x, runners


if __name__ == "__main__":
    main()
