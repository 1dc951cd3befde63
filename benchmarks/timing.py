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


class ColdReplay:
    """Milliseconds per replay of a CUDA graph with the L2 evicted before each, what a decode step
    between other layers sees: a ``flush_bytes`` buffer is *read* (evicting without leaving dirty
    lines to write back during the timed kernel), then events around the replay alone; ``warmup``
    replays first, the interquartile mean of ``iters``."""

    def __init__(self, warmup=25, iters=100, flush_bytes=256 << 20):
        self.warmup, self.iters, self.flush_bytes = warmup, iters, flush_bytes
        self.flush = self.sink = None

    def __call__(self, graph) -> float:
        if self.flush is None:
            self.flush = torch.ones(self.flush_bytes // 4, device="cuda")
            self.sink = torch.empty((), device="cuda")
        for _ in range(self.warmup):
            graph.replay()
        events = []
        for _ in range(self.iters):
            torch.sum(self.flush, dim=0, out=self.sink)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return iqm([s.elapsed_time(e) for s, e in events])


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
