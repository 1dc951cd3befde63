#!/usr/bin/env python3
"""One serial prefill for a profiler to look at (K1 and K2 launches):

    ncu --clock-control none -k regex:k2_recurrence --launch-count 1 --set full \\
        python3 -m benchmarks.profile_k2 --heads 4 --seq-len 8192 [--batch 8]
"""

import argparse

import torch

import cula_aot
from cula_aot.testing import standard_inputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1, help="fixed-length sequences of --seq-len tokens each")
    parser.add_argument("--intracard-cp", default="false", help="false, auto or an int s_split")
    args = parser.parse_args()
    choices = {"false": False, "auto": "auto"}
    split = choices[args.intracard_cp] if args.intracard_cp in choices else int(args.intracard_cp)
    # A fixed-length call's inputs, drawn on the host (seed 0) and moved to the GPU.
    x = standard_inputs(args.batch, args.seq_len, args.heads, device="cuda", seed=0, generator_device="cpu")
    cula_aot.kda_prefill(**x, output_final_state=True, intracard_cp=split)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
