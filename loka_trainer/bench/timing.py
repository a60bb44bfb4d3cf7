"""Latency timers: wall clock with synchronisation on CPU, CUDA events or ``triton.testing.do_bench`` on GPU.

Every timer runs ``warmup`` untimed calls, then returns the median of ``repeats`` timed calls in ms.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_wall(fn: Callable[[], object], *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median wall-clock ms of ``fn`` with a device synchronisation around every call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_cuda_events(fn: Callable[[], object], *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median ms of ``fn`` between CUDA events recorded on the current stream."""
    for _ in range(warmup):
        fn()
    n = max(1, repeats)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def time_do_bench(fn: Callable[[], object], *, warmup: int, repeats: int, device: torch.device) -> float:
    """Median ms from ``triton.testing.do_bench`` (flushes L2 between calls); triton is imported lazily."""
    from triton.testing import do_bench  # noqa: PLC0415 -- absent on CPU machines

    del device, warmup, repeats  # do_bench sizes its own warm-up and repeats by time
    return float(do_bench(fn, return_mode="median"))


TIMERS: dict[str, Callable[..., float]] = {
    "wall": time_wall,
    "cuda_events": time_cuda_events,
    "do_bench": time_do_bench,
}


def default_timer(device: torch.device) -> str:
    """``do_bench`` on CUDA when triton imports, else CUDA events; wall clock elsewhere."""
    if device.type != "cuda":
        return "wall"
    try:
        import triton.testing  # noqa: F401, PLC0415
    except ImportError:
        return "cuda_events"
    return "do_bench"
