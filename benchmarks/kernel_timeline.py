#!/usr/bin/env python3
"""Kernel timeline of three serial prefills (torch.profiler / CUPTI): each kernel's start and
duration, to see whether launches overlap (PDL, a streamed K2) and what each kernel takes in
place, where ncu would serialise them:

    python3 benchmarks/kernel_timeline.py 1x8192x4 8x1024x64   # BATCHxSEQ_LENxHEADS ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from profile_k2 import random_inputs
from torch.profiler import ProfilerActivity, profile

import cula_aot


def timeline(batch: int, seq_len: int, heads: int) -> list:
    """(name, start µs from the first kernel, duration µs) of every kernel of three calls, after five warm-up calls."""
    q, k, v, g, beta, a_log, dt_bias = random_inputs(batch, seq_len, heads)
    s0 = torch.zeros(batch, heads, 128, 128, device="cuda")

    def run():
        cula_aot.kda_prefill(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                             initial_state=s0, output_final_state=True, intracard_cp=False)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start
    return [(e.name, e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in kernels]


def main():
    for shape in sys.argv[1:]:
        batch, seq_len, heads = map(int, shape.split("x"))
        print(f"== {shape}")
        for name, start, duration in timeline(batch, seq_len, heads):
            print(f"  {name[:60]:60s} start {start:9.1f} us  dur {duration:8.1f} us")


if __name__ == "__main__":
    main()
