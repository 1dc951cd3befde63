"""CUDA-event timing shared by the benchmarks: warm-up, then the interquartile mean of runs;
and CUPTI kernel durations (torch.profiler)."""

import statistics

import torch
from torch.profiler import ProfilerActivity, profile


def iqm(samples):
    s = sorted(samples)
    q = len(s) // 4
    return statistics.fmean(s[q : len(s) - q])


def time_cuda(fn, warmup=25, iters=100):
    """Milliseconds per call of ``fn`` on the current stream (CONTRACT §7: 25 warm-up, 100 timed, IQM)."""
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


def kernel_medians_us(fn, calls=20, warmup=5) -> dict:
    """Median CUPTI duration (µs) per kernel name over ``calls`` calls of ``fn``, after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_name = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            by_name.setdefault(event.name, []).append(event.device_time)
    return {name: sorted(times)[len(times) // 2] for name, times in by_name.items()}


_CAPTURE_STREAM = {}


def capture_graph(fn, warmup=2):
    """A ``torch.cuda.CUDAGraph`` holding one call of ``fn`` (static inputs: the graph replays the
    same pointers).  ``fn`` first runs ``warmup`` times eagerly on the capture stream, so lazily
    sized buffers (cula_aot's per-stream workspace arena, Triton autotuning) exist before capture."""
    device = torch.cuda.current_device()
    stream = _CAPTURE_STREAM.setdefault(device, torch.cuda.Stream())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph
