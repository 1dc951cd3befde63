#!/usr/bin/env python3
"""The fused prefill's cost per tile and per work item: CUPTI durations (torch.profiler) of the
fused kernel alone at one wave of (sequence, head) items, over sequence lengths, with and
without the initial + final state, so a line through them gives the step per tile (slope) and
the fill/drain and state I/O per item (intercepts; PERFORMANCE.md, Fused prefill):

    python3 -m benchmarks.fused_item_cost [HEADS [BATCH]]     # default 64 2: 128 items
"""

import sys

import torch

from benchmarks.bench_prefill import LOWER_BOUND, make_inputs
from benchmarks.timing import kernel_medians_us
from cula_aot.ops.prefill import prefill

LENGTHS = (256, 512, 1024, 2048, 4096)


def fused_kernel_us(x, with_states: bool, calls: int = 20) -> float:
    """Median CUPTI duration (µs) of the fused kernel over ``calls`` calls on inputs ``x``."""
    out = torch.empty_like(x["v"])
    final = torch.empty_like(x["s0"]) if with_states else None

    def run():
        prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=x["A_log"],
            dt_bias=x["dt_bias"],
            lower_bound=LOWER_BOUND,
            initial_state=x["s0"] if with_states else None,
            out=out,
            final_state=final,
            output_final_state=with_states,
            intracard_cp=False,
            fused=True,
        )

    (us,) = [us for name, us in kernel_medians_us(run, calls).items() if "fused" in name]
    return us


def main():
    heads = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    points = {True: [], False: []}
    for seq_len in LENGTHS:
        x = make_inputs(heads, batch, None, seq_len, torch.device("cuda"))
        for with_states in (True, False):
            us = fused_kernel_us(x, with_states)
            points[with_states].append((seq_len // 16, us))
            print(
                f"H={heads} B={batch} T={seq_len} states={with_states}: {us:.1f} us, {us / (seq_len // 16):.3f} us per tile"
            )
    for with_states, line in points.items():
        (t0, u0), (t1, u1) = line[-2], line[-1]
        slope = (u1 - u0) / (t1 - t0)
        print(
            f"states={with_states}: {slope:.3f} us per tile, {u1 - slope * t1:.1f} us per item (the two longest lengths)"
        )


if __name__ == "__main__":
    main()
