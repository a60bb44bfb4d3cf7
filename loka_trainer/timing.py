"""Timers, all in microseconds: the one clock of Dispatch, the Probe's speedups, the Component Benchmark and the
benchmark scripts.

A ``Timer`` maps a callable to the median time (µs) of one call. ``wall_clock_timer`` for CPUs (and synchronized
GPU work), ``cuda_timer`` (CUDA events via triton's ``do_bench``) and ``cuda_graph_timer`` (GPU time from
CUDA-graph replay, without host cost) for GPUs; ``GPU_TIMERS`` names the GPU ones for configs.

``BENCH_TIMERS`` (the Component Benchmark's ``bench.timer``): functions ``(fn, *, warmup, repeats, device) -> µs``,
the median of ``repeats`` timed calls after ``warmup`` untimed ones (``do_bench`` sizes its own by time).
"""
from __future__ import annotations

import gc
import statistics
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

from loka_trainer.kernels.triton_env import triton_importable


Timer = Callable[[Callable[[], object]], float]  # fn -> median time in µs


def wall_clock_timer(repeats: int = 5, warmup: int = 1) -> Timer:
    """A timer for CPU: median wall-clock µs of ``repeats`` calls after ``warmup`` calls."""
    def timer(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    return timer


def cuda_timer() -> Timer:
    """A timer for GPUs: triton's ``do_bench`` median (ms -> µs); falls back to synchronized wall clock."""
    try:
        from triton.testing import do_bench
    except ImportError:
        wall = wall_clock_timer(repeats=20, warmup=3)
        return lambda fn: wall(lambda: (fn(), torch.cuda.synchronize()))
    return lambda fn: 1e3 * float(do_bench(fn, warmup=5, rep=20, return_mode="median"))


def with_grads_reset(fn: Callable[[], object], grad_to_none: Optional[Sequence[torch.Tensor]]
                     ) -> Callable[[], object]:
    """``fn`` preceded by setting each ``grad_to_none`` tensor's ``.grad`` to None (a training step after
    ``zero_grad(set_to_none=True)``); ``fn`` itself when there is none."""
    if not grad_to_none:
        return fn

    def call():
        for t in grad_to_none:
            t.grad = None
        return fn()
    return call


_GRAPH_TIMING_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def graph_timing_stream() -> "torch.cuda.Stream":
    """The one side stream (per device) every ``cuda_graph_us`` call of this process warms up, captures and
    replays on. Why not triton's ``do_bench_cudagraph``, which takes a new stream from torch's pool per call: cuBLAS
    keeps a workspace per stream for the life of the process (``torch.cuda.empty_cache`` does not free it), so
    Dispatch's layer timing left one per pool stream, 2.0 GiB allocated on the H200 after planning wukong_h200 or
    interformer_h200 (docs/results.md section 2)."""
    device = torch.cuda.current_device()
    if device not in _GRAPH_TIMING_STREAMS:
        _GRAPH_TIMING_STREAMS[device] = torch.cuda.Stream(device)
    return _GRAPH_TIMING_STREAMS[device]


def cuda_graph_us(fn: Callable[[], object], rep_ms: int = 20,
                  grad_to_none: Optional[Sequence[torch.Tensor]] = None, replays: int = 10) -> float:
    """GPU µs of one call of ``fn`` from CUDA-graph replay, after one call outside the capture (autotuning, lazy
    initialization, weight caches): one call captured and replayed estimates its time, then a graph of as many
    unrolled calls as fill ``rep_ms`` is replayed ``replays`` times; the median per call (triton's
    ``do_bench_cudagraph`` recipe, on ``graph_timing_stream``). ``grad_to_none``: leaf tensors whose ``.grad`` is
    reset before every captured call (as ``zero_grad(set_to_none=True)`` does), so a backward writes fresh
    gradients instead of adding into the last call's. Raises when ``fn`` cannot be captured.

    NOTE: ``gc.collect()`` after the first call. A reference cycle made during a first call (an exception
    caught inside Triton's autotuner, a lazy import) keeps that call's autograd graph alive until the
    collector runs, and with it the AccumulateGrad nodes of the leaves, created on the default stream: a
    backward captured on the side stream then invalidates the capture (seen on the H200 at the figure-13
    shape (7680, 256) and a 4096-row MLP stack, with torch's "AccumulateGrad node's stream does not match"
    warning).
    """
    fn()
    gc.collect()
    torch.cuda.synchronize()
    stream = graph_timing_stream()
    call = with_grads_reset(fn, grad_to_none)

    def captured(n: int) -> "torch.cuda.CUDAGraph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n):
                call()
        return graph

    def replay_ms(graph: "torch.cuda.CUDAGraph") -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)

    with torch.cuda.stream(stream):
        fn()  # the first call on this stream: what it allocates lazily per stream is made outside the capture
        stream.synchronize()
        repeat = max(1, int(rep_ms / max(replay_ms(captured(1)), 1e-3)))
        graph = captured(repeat)
        torch.cuda.synchronize()
        per_call = [replay_ms(graph) / repeat for _ in range(replays)]
    return 1e3 * statistics.median(per_call)


def cuda_graph_timer(fallback: Optional[Timer] = None) -> Timer:
    """A timer for GPUs: ``cuda_graph_us``; a call that cannot be captured is timed by ``fallback`` (default
    ``cuda_timer()``) with a warning.

    Why not ``cuda_timer``: event timing of single calls also counts the host's launch work whenever the host is
    slower than the kernels, and our FP8 paths run two or three Python-level custom ops per GEMM (~0.1–0.25 ms of
    host time each in the H200 profiles of docs/results.md). That is the likely reason a plan timed a fused Mods
    layer's FP8 forward at 554 µs against 411 µs for BF16 (8192×4096×4096) while timing the same FP8 GEMM, both
    quantizations included, at 270 µs against 343 µs. A compiled, GPU-bound training step hides host time, which
    argues for comparing GPU time (``precision.gpu_timer=cuda_graph``).
    """
    eager = fallback or cuda_timer()
    if not triton_importable():
        return eager

    def timer(fn: Callable[[], object]) -> float:
        try:
            return cuda_graph_us(fn)
        except Exception as exc:  # noqa: BLE001 -- any capture failure: time it without a graph instead
            torch.cuda.synchronize()
            warnings.warn(f"dispatch: CUDA-graph capture failed ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}); timed without a graph instead")
            return eager(fn)
    return timer


# ``precision.gpu_timer`` / ``precision.layer_timer`` -> how Dispatch times GEMM candidates / a fused Mods layer's
# whole step on a GPU. "cuda_events" (the GEMMs' default) is what the recorded plans used; "cuda_graph" is GPU time
# without host cost (``cuda_graph_timer``). End to end on the H200 (Wukong, docs/results.md §2) the graph-timed
# plan chose more FP8 GEMMs and trained 1.8% slower. A fused layer's eager step is host-bound, though: 680-1470 µs
# by events (six repeats of one step spread by up to 75%) for 32-91 µs of GPU time at batch 4096, whose
# graph-replay repeats agree within 2% (H200, docs/kernels/README.md "Measured limits"). So layer choices are timed by
# graph replay unless ``layer_timer`` says otherwise.
GPU_TIMERS: dict[str, Callable[[], Timer]] = {"cuda_events": cuda_timer, "cuda_graph": cuda_graph_timer}


def default_timer(device: torch.device | str, gpu_timer: str = "cuda_events") -> Timer:
    """``GPU_TIMERS[gpu_timer]`` on CUDA, wall clock elsewhere."""
    return GPU_TIMERS[gpu_timer]() if torch.device(device).type == "cuda" else wall_clock_timer()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_wall(fn: Callable[[], object], *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median wall-clock µs of ``fn`` with a device synchronisation around every call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def time_cuda_events(fn: Callable[[], object], *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median µs of ``fn`` between CUDA events recorded on ``device``'s current stream (where ``fn``'s kernels on
    that device run, whichever device is the process's current one)."""
    for _ in range(warmup):
        fn()
    n = max(1, repeats)
    stream = torch.cuda.current_stream(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record(stream)
        fn()
        e.record(stream)
    torch.cuda.synchronize(device)
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_do_bench(fn: Callable[[], object], *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median µs from ``triton.testing.do_bench`` (flushes L2 between calls) with ``device`` made the current
    CUDA device, as do_bench's events, cache flush and synchronisation use it; triton is imported lazily."""
    from triton.testing import do_bench  # absent on CPU machines

    del warmup, repeats  # do_bench sizes its own warm-up and repeats by time
    with torch.cuda.device(device):
        return 1e3 * float(do_bench(fn, return_mode="median"))


BENCH_TIMERS: dict[str, Callable[..., float]] = {
    "wall": time_wall,
    "cuda_events": time_cuda_events,
    "do_bench": time_do_bench,
}
# The bench timers that time CUDA work only (on another device each call fails)
CUDA_BENCH_TIMERS = ("cuda_events", "do_bench")


def default_bench_timer(device: torch.device) -> str:
    """``do_bench`` on CUDA when triton imports, else CUDA events; wall clock elsewhere."""
    if device.type != "cuda":
        return "wall"
    return "do_bench" if triton_importable() else "cuda_events"
