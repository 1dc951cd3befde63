#!/usr/bin/env python3
"""Where an unbounded gate pays: CUPTI durations (torch.profiler, median of 20 calls) of the fused
kernel and of K1 + K2 under each gate and decay regime, so what fast decay costs (phase C,
``prepare_tile.unbounded_operands``) shows apart from the softplus itself:

    python3 -m benchmarks.gate_regimes [--tag NAME] [--set all|safe|unbounded]

Regimes of the softplus gate's A_log on the benchmark inputs (``bench_prefill.make_inputs``):
"std" (log U(1, 16): the fast heads put many tokens at the gate's floor, 2^-14), "A0"
(e^A_log = 1: none at the floor) and "A16" (e^A_log = 16 on every head: about half at it);
"precomputed" takes the standard inputs' softplus log-decay.  Initial and final state, serial
path.
"""

import argparse

import torch

from benchmarks.bench_prefill import LOWER_BOUND, make_inputs
from benchmarks.timing import kernel_medians_us
from cula_aot import reference
from cula_aot.ops.prefill import prefill

SHAPES = ((16, 8, 1024), (12, 1, 8192))  # (H, B, T): a fused row of the benchmark, a production shard
CASES = {
    "safe": (("safe", "std"),),
    "unbounded": (("softplus", "std"), ("softplus", "A0"), ("softplus", "A16"), ("precomputed", "std")),
}
CASES["all"] = CASES["safe"] + CASES["unbounded"]


def kernel_us(x, gate, a_log, dt_bias, fused) -> dict:
    """Median CUPTI µs per kernel (a short name) of 20 prefills of ``x``."""
    out, final = torch.empty_like(x["v"]), torch.empty_like(x["s0"])

    def run():
        prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            A_log=a_log,
            dt_bias=dt_bias,
            lower_bound=LOWER_BOUND if gate == "safe" else None,
            initial_state=x["s0"],
            out=out,
            final_state=final,
            output_final_state=True,
            intracard_cp=False,
            fused=fused,
            gate=gate,
        )

    return {name.split("(")[0][7:30]: us for name, us in kernel_medians_us(run).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="here", help="a label for the tree or artifacts measured")
    parser.add_argument("--set", default="all", choices=sorted(CASES))
    args = parser.parse_args()
    for heads, batch, seq_len in SHAPES:
        x = make_inputs(heads, batch, None, seq_len, torch.device("cuda"))
        regimes = {"std": x["A_log"], "A0": torch.zeros_like(x["A_log"]), "A16": torch.full_like(x["A_log"], 2.7726)}
        for fused in (True, False):
            for gate, regime in CASES[args.set]:
                y, a_log, dt_bias = dict(x), regimes[regime], x["dt_bias"]
                if gate == "precomputed":
                    y["g"] = reference.gate(x["g"], x["A_log"], x["dt_bias"], None, "softplus").to(torch.bfloat16)
                    a_log = dt_bias = None
                times = kernel_us(y, gate, a_log, dt_bias, fused)
                print(
                    f"[{args.tag}] H{heads} {batch}x{seq_len} fused={fused} {gate:11s} {regime:4s} "
                    + "  ".join(f"{name}={us:.1f}" for name, us in times.items()),
                    flush=True,
                )


if __name__ == "__main__":
    main()
