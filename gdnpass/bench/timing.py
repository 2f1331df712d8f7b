"""How the benchmarks time kernels: profiler kernel durations of a call captured as a CUDA graph and replayed (the
seed's and upstream's method: no launch gaps), CUDA events around replays of a graph of repeated calls, or CUDA events
around plain calls, outside any capture or profiler (how a ceiling is timed: gdnpass.bench.ceilings); and one node of
an executor as a callable to time."""

from __future__ import annotations

import statistics

import torch

from gdnpass.runtime import Executor

REPS_IN_GRAPH = 20


def graph_time_us(fn, reps_in_graph=REPS_IN_GRAPH, replays=30) -> float:
    """Median GPU time of one ``fn()`` call: a CUDA graph of ``reps_in_graph`` calls, replayed, timed with events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # warm up (compiles Triton kernels outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps_in_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps_in_graph)
    return statistics.median(times)


def events_us(fn, reps: int = 20, calls: int = 4) -> float:
    """Median GPU time of one ``fn()`` call, us: CUDA events around ``calls`` back-to-back calls, ``reps`` times, after
    a warm-up; no capture, no profiler (a memcpy captured in a graph under the profiler ran 1.6x slower than this).
    For work of hundreds of us (a ceiling's 1 GiB), where the launches between the events cost under 1%."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def kernel_us(fn, reps: int = 20, only: str | None = None) -> tuple[float, list[float]]:
    """Profiler kernel durations of one ``fn()`` call, captured as a CUDA graph and replayed (so host-side checks,
    e.g. GET_ROWS's id check, which is skipped under capture, launch nothing): (median over ``reps`` replays of the
    summed kernel time, the median duration of each of its kernels in launch order), in µs; ``only``: of the kernels
    whose name contains it (a quantized mat-vec without its pre-pass, say).

    Captured with programmatic dependent launch off: under it a kernel starts while its predecessor runs and waits
    inside, and its duration counts that wait, so back-to-back launches (a product over rotated weight copies) summed
    to more than their work."""
    from gdnpass.kernels.triton_core import programmatic_launch

    with programmatic_launch(False):
        return _kernel_us(fn, reps, only)


def _kernel_us(fn, reps: int, only: str | None) -> tuple[float, list[float]]:
    calls = [[e.device_time for e in c] for c in _profiled(fn, reps, only)]
    per_kernel = [statistics.median(c[j] for c in calls) for j in range(len(calls[0]))]
    return statistics.median(sum(c) for c in calls), per_kernel


def kernel_advances(fn, reps: int = 10) -> tuple[float, list[float]]:
    """How far each kernel of one ``fn()`` call moves the end of the work, captured as a CUDA graph as the launch
    options stand (programmatic dependent launch on or off) and replayed under the profiler: (median of the first
    kernel's start to the last one's end, the median of each kernel's end minus the end of the one before it, the
    first's its duration), in µs. Their sum is the span; under programmatic dependent launch a kernel's advance is
    what it costs the stream, its wait inside not counted, so two captures compare kernel by kernel where the time
    goes (a kernel duration, :func:`kernel_us`, counts the wait)."""
    replays = [stream_advances([(e.time_range.start, e.time_range.end) for e in c]) for c in _profiled(fn, reps, None)]
    return (statistics.median(span for span, _ in replays),
            [statistics.median(a[j] for _, a in replays) for j in range(len(replays[0][1]))])


def stream_advances(ranges: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """One replay's (start, end) of each kernel, in launch order -> (its span: the first start to the last end, each
    kernel's advance of the end: its end minus the one before's, the first's its duration). The advances sum to
    the span, however the kernels overlap."""
    ends = [end for _, end in ranges]
    return ends[-1] - ranges[0][0], [ends[0] - ranges[0][0]] + [b - a for a, b in zip(ends, ends[1:])]


def _profiled(fn, reps: int, only: str | None) -> list[list]:
    """The kernel events of ``reps`` replays of one ``fn()`` call captured as a CUDA graph, a list a replay, in order
    (``only``: those whose name contains it)."""
    from torch.profiler import ProfilerActivity, profile

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # warm up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and (only is None or only in e.name)),
                key=lambda e: e.time_range.start)
    per = len(ks) // reps
    if per == 0 or len(ks) % reps:
        raise RuntimeError(f"{len(ks)} kernels over {reps} replays: not one fixed launch sequence")
    return [ks[i * per:(i + 1) * per] for i in range(reps)]


def node_runner(ex: Executor, n):
    """Node ``n`` of ``ex``'s graph as a call of its kernel on the executor's views (what the timings above take),
    its pre-pass skipped or its output made quantized as the executor's plan says (gdnpass.prepasses)."""
    fn = ex.kernels[n.op]
    srcs = [ex.view(s) if s is not None else None for s in [*n.src, *n.outs]]
    out = ex.view(n)

    def call():
        with ex.node_context(n):
            fn(n, srcs, out)
    return call
