"""How the GPU benchmark scripts time one call: GPU time from CUDA-graph replay, launch-bound eager time apart.

``time_row(row, fn, grad_to_none)`` fills a result row with ``graph_us`` (``timing.cuda_graph_us``; when its
capture fails, the traceback's both ends and a fallback capture with PyTorch's recipe) and ``eager_us``
(``triton.testing.do_bench``). Used by ``scripts.bench_dispatch_gpu`` and the layer benchmarks in ``benchmarks/``.
"""
from __future__ import annotations

import gc
import time
import traceback

import torch

from loka_trainer.timing import cuda_graph_us, graph_timing_stream, with_grads_reset


def manual_graph_us(fn, num_calls: int = 20, num_replays: int = 20, grad_to_none=None) -> float:
    """Fallback graph timer (PyTorch's documented capture recipe: 3 warm-up calls on a side stream, then
    ``num_calls`` unrolled calls in one graph); median µs per call over ``num_replays`` replays.

    Captured with ``capture_error_mode="thread_local"``: a CUDA call another thread makes during the capture
    (which invalidates a capture in the default "global" mode) does not fail this one."""
    call = with_grads_reset(fn, grad_to_none)
    side = graph_timing_stream()  # one stream: cuBLAS keeps a workspace per stream it ran on
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    gc.collect()  # see timing.cuda_graph_us
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        for _ in range(num_calls):
            call()
    times = []
    for _ in range(num_replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_calls)
    return sorted(times)[len(times) // 2]


def both_ends(text: str, n: int) -> str:
    """``text``, or its first and last ``n`` characters when longer than 2n."""
    return text if len(text) <= 2 * n else text[:n] + "\n[...]\n" + text[-n:]


def time_row(row: dict, fn, grad_to_none=None) -> None:
    """Fill row's graph_us / eager_us; if cuda_graph_us's capture fails, record why and use the fallback.

    ``grad_to_none``: leaf tensors whose ``.grad`` is reset before each call (a training step after
    ``zero_grad(set_to_none=True)``: gradients are written, not added into the last call's); None keeps them
    accumulating across calls, as the runs recorded before 2026-11-30 did (CHANGELOG.md). ``wall_s``: seconds the whole
    measurement took, the first call's compilation and autotuning included (where a suite's time goes)."""
    start = time.perf_counter()
    try:
        _time_row(row, fn, grad_to_none)
    finally:
        row["wall_s"] = round(time.perf_counter() - start, 2)


def _time_row(row: dict, fn, grad_to_none) -> None:
    try:
        row["graph_us"] = cuda_graph_us(fn, rep_ms=50, grad_to_none=grad_to_none)
    except Exception as e:
        # both ends: a capture error is chained, and its cause (the first exception) comes first
        row["graph_error"] = both_ends(traceback.format_exc(), 1500)
        torch.cuda.synchronize()
        try:
            row["graph_us"], row["timer"] = manual_graph_us(fn, grad_to_none=grad_to_none), "manual_graph_thread_local"
        except Exception as e2:
            row["error"] = f"{type(e).__name__}: {e} | fallback {type(e2).__name__}: {e2}"[:400]
            return
    row["eager_us"] = eager_us(fn, grad_to_none)
    row["grads"] = "accumulated" if grad_to_none is None else "reset"


def eager_us(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench
    return 1e3 * float(do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median"))
