"""CUDA-event timing shared by the benchmarks: warm-up, then the interquartile mean of runs."""

import statistics

import torch


def iqm(samples):
    s = sorted(samples)
    q = len(s) // 4
    return statistics.fmean(s[q : len(s) - q])


def time_cuda(fn, warmup=25, iters=100):
    """Milliseconds per call of ``fn`` on the current stream (SPEC §7: 25 warm-up, 100 timed, IQM)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return iqm(times)
