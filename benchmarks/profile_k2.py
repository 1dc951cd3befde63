#!/usr/bin/env python3
"""One serial prefill for a profiler to look at (K1 and K2 launches):

    ncu --clock-control none -k regex:k2_recurrence --launch-count 1 --set full \\
        python3 benchmarks/profile_k2.py --heads 4 --seq-len 8192 [--batch 8]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch

import cula_aot


def random_inputs(batch: int, seq_len: int, heads: int):
    """q, k, v, g, β (bf16, seeded) and the gate parameters of a fixed-length call, on the GPU."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (batch, seq_len, heads, 128)
    q, k, v, g = (torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda() for _ in range(4))
    beta = torch.randn(*shape[:3], generator=gen).to(torch.bfloat16).cuda()
    a_log = torch.log(torch.rand(heads, generator=gen) * 15 + 1).cuda()
    dt_bias = (0.1 * torch.randn(heads, 128, generator=gen)).cuda()
    return q, k, v, g, beta, a_log, dt_bias


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="fixed-length sequences of --seq-len tokens each")
    parser.add_argument("--intracard-cp", default="false", help="false, auto or an int s_split")
    args = parser.parse_args()
    choices = {"false": False, "auto": "auto"}
    split = choices[args.intracard_cp] if args.intracard_cp in choices else int(args.intracard_cp)
    q, k, v, g, beta, a_log, dt_bias = random_inputs(args.batch, args.seq_len, args.heads)
    cula_aot.kda_prefill(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0,
                         output_final_state=True, intracard_cp=split)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
