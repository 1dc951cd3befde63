#!/usr/bin/env python3
"""Kernel timeline of three prefills (torch.profiler / CUPTI): each kernel's start and
duration, to see whether launches overlap (PDL, a streamed K2) and what each kernel takes in
place, where ncu would serialise them:

    python3 -m benchmarks.kernel_timeline 1x8192x4 8x1024x64   # BATCHxSEQ_LENxHEADS ..., serial
    python3 -m benchmarks.kernel_timeline --cp 16 --varlen 1x16384x8   # intracard CP, cu_seqlens
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import cula_aot
from cula_aot.testing import standard_inputs


def timeline(batch: int, seq_len: int, heads: int, intracard_cp=False, varlen=False) -> list:
    """(name, start µs from the first kernel, duration µs) of every kernel of three calls, after
    five warm-up calls; ``varlen``: the batch as one cu_seqlens sequence each (host copy given).
    Inputs: ``cula_aot.testing.standard_inputs`` drawn on the host with seed 0."""
    x = standard_inputs(batch, seq_len, heads, device="cuda", seed=0, generator_device="cpu")
    q, k, v, g, beta, a_log, dt_bias = (x[name] for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))
    s0 = torch.zeros(batch, heads, 128, 128, device="cuda")
    lengths = {}
    if varlen:
        q, k, v, g, beta = (t.flatten(0, 1).unsqueeze(0) for t in (q, k, v, g, beta))
        cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32)
        lengths = {"cu_seqlens": cu.cuda(), "cu_seqlens_cpu": cu}

    def run():
        cula_aot.kda_prefill(
            q,
            k,
            v,
            g,
            beta,
            A_log=a_log,
            dt_bias=dt_bias,
            lower_bound=-5.0,
            initial_state=s0,
            output_final_state=True,
            intracard_cp=intracard_cp,
            **lengths,
        )

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="+", help="BATCHxSEQ_LENxHEADS")
    parser.add_argument("--cp", type=int, default=False, help="intracard_cp s_split (default: serial)")
    parser.add_argument("--varlen", action="store_true", help="pass the batch as cu_seqlens sequences")
    args = parser.parse_args()
    for shape in args.shapes:
        batch, seq_len, heads = map(int, shape.split("x"))
        print(f"== {shape}")
        for name, start, duration in timeline(batch, seq_len, heads, args.cp, args.varlen):
            print(f"  {name[:60]:60s} start {start:9.1f} us  dur {duration:8.1f} us")


if __name__ == "__main__":
    main()
