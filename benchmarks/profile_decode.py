#!/usr/bin/env python3
"""A few decode steps for a profiler to look at (one ``kda_decode`` launch each):

    ncu --clock-control none -k regex:kda_decode --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \\
        python3 benchmarks/profile_decode.py --heads 64 --seqs 1024 --tokens 4 --dtype bf16

``--variant 32x2`` picks the (v_block, items) kernel (default: ``pick_variant``).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch

from cula_aot.ops.decode import decode


def parse_variant(name):
    """"32x2" → (32, 2), "chunk4x2" → ("chunk", 4, 2) (``bench_decode.variant_name`` inverted)."""
    if name is None:
        return None
    if name.startswith("chunk"):
        return ("chunk", *map(int, name[len("chunk"):].split("x")))
    return tuple(map(int, name.split("x")))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--seqs", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variant", default=None, help="e.g. 32x2 or chunk4x2 (default: pick_variant)")
    args = parser.parse_args()
    n, t, h = args.seqs, args.tokens, args.heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, g = (torch.randn(n, t, h, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(4))
    beta = torch.randn(n, t, h, generator=gen, device="cuda").to(torch.bfloat16)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    pool = (0.1 * torch.randn(n, h, 128, 128, generator=gen, device="cuda")).to(dtype)
    indices = torch.randperm(n, device="cuda").to(torch.int32)
    a_log = torch.log(torch.rand(h, generator=gen, device="cuda") * 15 + 1)
    dt_bias = 0.1 * torch.randn(h, 128, generator=gen, device="cuda")
    for _ in range(args.steps):
        decode(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0, state_pool=pool,
               state_indices=indices, variant=parse_variant(args.variant))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
