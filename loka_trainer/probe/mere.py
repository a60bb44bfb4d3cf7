"""MERE, the one error measure of LoKA, and the offline error and speed of candidate GEMM kernels (III-A).

MERE(out, ref) = mean_ij |out_ij − ref_ij| / max(|ref_ij|, floor),  floor = zero_floor · mean_ij |ref_ij|.

Near-zero references: an output element whose exact value is ~0 has an unbounded relative error, and with
continuous inputs a fixed fraction of elements is arbitrarily close to 0, so the plain mean diverges as the
sample grows. The denominator is therefore floored at ``zero_floor`` (default 1e-2) times the mean |ref| of
the same output; such elements are counted (not dropped), with their error measured relative to the output's
typical magnitude. If all of ref is 0 the floor falls back to the smallest normal fp32, so an exact kernel
still scores 0 (and any error scores huge). The floor is one option for both users: Dispatch reads
``precision.mere_zero_floor``, the report ``--zero-floor``. For scale (CPU, x 512x512 and w 256x512 standard
normal): bf16 0.009, e4m3 rowwise 0.14 with the default floor; 0.02 and 0.36 with no floor at all.

Reference convention (Dispatch and the report): the kernel and the reference get the same operands, in the
training's compute dtype (BF16 under LoKA: ``operands``), and the reference is their product in fp32 with TF32
off (``exact_fp32_forward``). Why: in training the GEMM's inputs are already BF16, so rounding them is not the
kernel's error, and fp32 accumulation of exact BF16 products (relative error ~1e-6 at these K) is far below any
MERE that decides anything, so fp64 would change nothing.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterator, Optional

import torch

from loka_trainer.matmul_precision import exact_fp32_matmuls

DEFAULT_ZERO_FLOOR = 1e-2
# ``--operand-dtype`` / ``precision.compute_dtype`` -> the dtype a kernel's operands have in training.
OPERAND_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

GemmFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x (M, K), w (N, K) -> y (M, N)


@torch.no_grad()
def mere(out: torch.Tensor, ref: torch.Tensor, *, zero_floor: float = DEFAULT_ZERO_FLOOR) -> torch.Tensor:
    """Mean element-wise relative error. out, ref: same shape (any) -> scalar fp32 tensor."""
    if out.shape != ref.shape:
        raise ValueError(f"out {tuple(out.shape)} and ref {tuple(ref.shape)} differ in shape")
    out, ref = out.float(), ref.float()
    abs_ref = ref.abs()
    floor = (zero_floor * abs_ref.mean()).clamp_min(torch.finfo(torch.float32).tiny)
    return ((out - ref).abs() / torch.maximum(abs_ref, floor)).mean()


def operands(x: torch.Tensor, w: torch.Tensor,
             dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), w (N, K) cast to the training's operand dtype: what both the kernel and the reference get."""
    return x.to(dtype), w.to(dtype)


@torch.no_grad()
def exact_fp32_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reference y = x W^T in fp32 without TF32. x: (M, K), w: (N, K) -> (M, N)."""
    with exact_fp32_matmuls():
        return x.float() @ w.float().T


@torch.no_grad()
def accumulate_mere(pairs: Iterator[tuple[torch.Tensor, torch.Tensor]], kernels: dict[str, GemmFn], *,
                    zero_floor: float = DEFAULT_ZERO_FLOOR, operand_dtype: torch.dtype = torch.bfloat16,
                    progress: Optional[Callable[[], None]] = None) -> dict[str, float]:
    """Average MERE of each kernel over sampled pairs (x (M, K), w (N, K)), both cast to ``operand_dtype``
    before the kernel and the fp32 reference see them (the module's reference convention)."""
    totals = {name: 0.0 for name in kernels}
    num_pairs = 0
    for x, w in pairs:
        x, w = operands(x, w, operand_dtype)
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
