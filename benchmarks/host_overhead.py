"""Where an eager call's host time goes: the host time of bursts of calls short enough that the
launch queue never fills (so the GPU never holds the host back), the same with the driver launches
stubbed out (the Python part), one driver launch from packed parameters, then a cProfile of the loop.

    python -m benchmarks.host_overhead [--calls 3000] [--varlen]   # a serial prefill, tiny problem
    python -m benchmarks.host_overhead --decode [--tokens T]       # kda_decode, N 32, H 12, fp32 pool
"""

import argparse
import cProfile
import pstats
import time

import torch

import cula_aot
from cula_aot.testing import cu_seqlens_of, standard_inputs


def step_inputs(x: dict) -> tuple:
    """``standard_inputs``' q, k, v, g, β (positional) and the safe gate's keyword arguments."""
    return [x[n] for n in ("q", "k", "v", "g", "beta")], {n: x[n] for n in ("A_log", "dt_bias", "lower_bound")}


def prefill_call(varlen: bool):
    heads = 8
    if varlen:
        x = standard_inputs(1, 64, heads, device="cuda")
        extra = dict(
            cu_seqlens=cu_seqlens_of([16, 16, 16, 16], "cuda"),
            initial_state=torch.zeros(8, heads, 128, 128, device="cuda"),
            output_final_state=True,
            state_indices=torch.tensor([1, 3, 5, 7], dtype=torch.int32, device="cuda"),
        )
    else:
        x = standard_inputs(1, 16, heads, device="cuda")
        extra = dict(
            initial_state=torch.zeros(1, heads, 128, 128, device="cuda"),
            final_state=torch.zeros(1, heads, 128, 128, device="cuda"),
        )
    out = torch.empty_like(x["v"])
    inputs, gate = step_inputs(x)

    def call():
        cula_aot.kda_prefill(*inputs, **gate, out=out, intracard_cp=False, **extra)

    return call, "varlen pool prefill" if varlen else "fixed prefill"


def decode_call(tokens: int):
    """The engine's decode step: 32 requests of 12 heads, slots scattered over a larger fp32 pool."""
    requests, heads = 32, 12
    x = standard_inputs(requests, tokens, heads, device="cuda")
    pool = torch.zeros(2 * requests, heads, 128, 128, device="cuda")
    slots = torch.arange(1, 2 * requests, 2, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x["v"])
    inputs, gate = step_inputs(x)

    def call():
        cula_aot.kda_decode(*inputs, **gate, state_pool=pool, state_indices=slots, out=out)

    return call, f"decode N{requests} H{heads} T{tokens}"


def burst_us(fn, calls=300, rounds=10):
    """Median over rounds of host µs per call for ``calls`` back-to-back calls after a sync
    (≤ 2·calls launches in flight: the driver's queue does not fill)."""
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append(1e6 * (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--varlen", action="store_true", help="4 sequences via a device cu_seqlens and a state pool")
    parser.add_argument("--decode", action="store_true", help="kda_decode at N 32, H 12 over an fp32 pool instead")
    parser.add_argument("--tokens", type=int, default=1, help="--decode: tokens per request")
    args = parser.parse_args()
    call, label = decode_call(args.tokens) if args.decode else prefill_call(args.varlen)

    for _ in range(200):
        call()
    print(f"{label}: host {burst_us(call):.1f} us/call (bursts of 300 calls, median of 10)")

    from cula_aot.runtime import loader

    real = loader.LoadedKernel.launch_packed
    launches = []

    def record(self, packed, grid, stream, smem_bytes=None, dependent=False):
        launches.append((self, packed, grid, stream, smem_bytes, dependent))

    loader.LoadedKernel.launch_packed = record
    print(f"{label}: host {burst_us(call):.1f} us/call with the driver launches stubbed (the Python part)")
    loader.LoadedKernel.launch_packed = real

    # The last launch's packed parameters, launched again (it repeats that kernel's work on live
    # tensors): the driver launch alone, through the loader's buffer.
    kernel, packed, grid, stream, smem_bytes, dependent = launches[-1]

    def driver_launch():
        kernel.launch_packed(packed, grid, stream, smem_bytes, dependent=dependent)

    print(
        f"driver launch (cuLaunchKernel of {kernel.name} from packed parameters): {burst_us(driver_launch, 500):.2f} us"
    )

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        call()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
