"""Error and speed of candidate GEMM kernels on sampled operands (LoKA III-A offline phase).

MERE is ``kernels.error.mere`` (one definition for the Probe and Dispatch; its docstring has the formula and
the near-zero floor). For scale (CPU, x 512x512 and w 256x512 standard normal): bf16 0.009, e4m3 rowwise
0.14 with the default 1e-2 floor; 0.02 and 0.36 with no floor at all, which is how strongly near-zero outputs
dominate an unguarded MERE.

The reference is an fp32 GEMM with TF32 disabled (``exact_fp32_forward``).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Iterator, Optional

import torch

from loka_trainer.kernels.error import DEFAULT_ZERO_FLOOR, mere  # noqa: F401 (re-exported)

GemmFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x (M, K), w (N, K) -> y (M, N)


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """fp32 matmuls at full precision (no TF32 on CUDA) inside the block."""
    old_precision = torch.get_float32_matmul_precision()
    old_cuda, old_cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old_precision)
        torch.backends.cuda.matmul.allow_tf32 = old_cuda
        torch.backends.cudnn.allow_tf32 = old_cudnn


@torch.no_grad()
def exact_fp32_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference y = x W^T in fp32 without TF32. x: (M, K), w: (N, K) -> (M, N)."""
    with no_tf32():
        return x.float() @ w.float().T


@torch.no_grad()
def accumulate_mere(pairs: Iterator[tuple[torch.Tensor, torch.Tensor]], kernels: dict[str, GemmFn], *,
                    zero_floor: float = DEFAULT_ZERO_FLOOR,
                    progress: Optional[Callable[[], None]] = None) -> dict[str, float]:
    """Average MERE of each kernel over sampled pairs (x (M, K), w (N, K)); one fp32 reference per pair."""
    totals = {name: 0.0 for name in kernels}
    num_pairs = 0
    for x, w in pairs:
        ref = exact_fp32_forward(x, w)
        for name, fn in kernels.items():
            totals[name] += float(mere(fn(x, w), ref, zero_floor=zero_floor))
        num_pairs += 1
        if progress is not None:
            progress()
    if num_pairs == 0:
        raise ValueError("accumulate_mere needs at least one sampled pair")
    return {name: total / num_pairs for name, total in totals.items()}


def _bench_cuda(fn: Callable[[], object]) -> Optional[float]:
    """Median seconds via triton.testing.do_bench when triton imports (GPU machines only)."""
    try:
        from triton.testing import do_bench  # lazy: triton does not exist on CPU machines
    except ImportError:
        return None
    return float(do_bench(fn, return_mode="median")) * 1e-3


def _bench_wall(fn: Callable[[], object], *, device: torch.device, reps: int, warmup: int) -> float:
    """Median wall-clock seconds (synchronizing the device around each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median_time(fn: GemmFn, x: torch.Tensor, w: torch.Tensor, *, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of fn(x, w) on x's device: do_bench on CUDA with triton, wall clock otherwise."""
    call = lambda: fn(x, w)  # noqa: E731
    if x.device.type == "cuda":
        seconds = _bench_cuda(call)
        if seconds is not None:
            return seconds
    return _bench_wall(call, device=x.device, reps=reps, warmup=warmup)
