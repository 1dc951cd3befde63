"""Where a serial prefill's host time goes: per-call wall time of a tiny problem with the GPU
kept ahead (so the host is the bottleneck), then a cProfile of the same loop.

    python benchmarks/host_overhead.py [--calls 3000] [--varlen]
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

import cula_aot  # noqa: E402
from tests.helpers import cu_seqlens_of, standard_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--varlen", action="store_true", help="4 sequences via a device cu_seqlens and a state pool")
    args = parser.parse_args()
    heads = 8
    if args.varlen:
        x = standard_inputs(1, 64, heads, device="cuda")
        cu = cu_seqlens_of([16, 16, 16, 16], "cuda")
        pool = torch.zeros(8, heads, 128, 128, device="cuda")
        extra = dict(cu_seqlens=cu, initial_state=pool, output_final_state=True,
                     state_indices=torch.tensor([1, 3, 5, 7], dtype=torch.int32, device="cuda"))
    else:
        x = standard_inputs(1, 16, heads, device="cuda")
        extra = dict(initial_state=torch.zeros(1, heads, 128, 128, device="cuda"),
                     final_state=torch.zeros(1, heads, 128, 128, device="cuda"))
    out = torch.empty_like(x["v"])

    def call():
        cula_aot.kda_prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                             lower_bound=x["lower_bound"], out=out, intracard_cp=False, **extra)

    for _ in range(200):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    print(f"{'varlen pool' if args.varlen else 'fixed'}: host {1e6 * host / args.calls:.1f} us/call, "
          f"wall {1e6 * wall / args.calls:.1f} us/call over {args.calls} calls")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        call()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
