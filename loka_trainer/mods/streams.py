"""Two independent GPU computations side by side: the weight grad on a second stream during the input grad.

Why: a layer's backward GEMMs dx = dz·W and dW = dzᵀ·x both need only dz. At batch 1024 and small widths
each is a handful of output tiles on a GPU of 132 SMs, latency-bound; run one after the other they cost the
sum of two latencies, on two streams about the larger one. Inside a CUDA graph capture the fork and join
below become graph dependencies, so the replayed graph runs the two GEMMs concurrently too.

Used only on CUDA outside ``torch.compile`` tracing (elsewhere the two run in order, same results).
"""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")
U = TypeVar("U")

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One extra stream per device, made once (not per call: a capture then always sees the same one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def side_by_side(main: Optional[Callable[[], T]], side: Optional[Callable[[], U]], device: torch.device, *,
                 concurrent: bool = True) -> tuple[Optional[T], Optional[U]]:
    """(main(), side()) with ``side`` on a second CUDA stream while ``main`` runs on the current one; either may
    be None (not run). Concurrent only when both are given, ``device`` is CUDA, torch.compile is not tracing
    and ``concurrent`` (``ModsKernelConfig.backward_streams``).

    ``side``'s inputs must be ready on the current stream (the side stream waits for it first) and its result
    must be a tensor; the current stream waits for the side stream before returning, so everything after
    this call sees both results.
    """
    if not concurrent or main is None or side is None or device.type != "cuda" or torch.compiler.is_compiling():
        return (main() if main is not None else None), (side() if side is not None else None)
    current = torch.cuda.current_stream(device)
    stream = _side_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        side_out = side()
    main_out = main()
    current.wait_stream(stream)
    side_out.record_stream(current)  # allocated on the side stream, used on this one from now on
    return main_out, side_out
