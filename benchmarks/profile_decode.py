#!/usr/bin/env python3
"""A few decode steps for a profiler to look at (one ``kda_decode`` launch each):

    ncu --clock-control none -k regex:kda_decode --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \\
        python3 -m benchmarks.profile_decode --heads 64 --seqs 1024 --tokens 4 --dtype bf16

``--variant 32x2`` picks the (v_block, items) kernel (default: ``pick_variant``).
"""

import argparse

import torch

from cula_aot.ops.decode import decode
from cula_aot.testing import standard_inputs


def parse_variant(name):
    """ "32x2" → (32, 2), "chunk4x2" → ("chunk", 4, 2) (``bench_decode.variant_name`` inverted)."""
    if name is None:
        return None
    if name.startswith("chunk"):
        return ("chunk", *map(int, name[len("chunk") :].split("x")))
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
    x = standard_inputs(n, t, h, device="cuda", seed=0, n_states=n)  # the pool: one slot per sequence
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    pool = x.pop("initial_state").to(dtype)
    indices = torch.randperm(n, device="cuda").to(torch.int32)
    for _ in range(args.steps):
        decode(**x, state_pool=pool, state_indices=indices, variant=parse_variant(args.variant))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
