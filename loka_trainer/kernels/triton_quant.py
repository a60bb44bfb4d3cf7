"""Fused FP8 quantization in one Triton kernel per call: amax -> scale -> saturating cast (rowwise).

Notation: t (R, C) any 2-D view (e.g. ``dy.t()``), contraction dim C. ``quantize_rowwise_fused(t)`` returns
q (R, C) contiguous fp8 and scale_inv (R, 1) fp32 with ``t ≈ q * scale_inv`` — the same math as
``quant.quantize_rowwise`` (EPS clamp, saturating cast), so it is a drop-in for it.

Why one kernel: the eager chain (abs, amax, clamp, div, mul, clamp, cast) is ~7 launches and ~5 passes over
t; here each program owns ROWS rows and reads them once (rows up to ``SINGLE_PASS_MAX_COLS`` long, held in
registers) or twice (longer rows: once for the amax, once more, mostly from L2, for the cast).
A transposed view (``dy.t()`` for the weight-grad GEMM) is read with its own strides, so no ``.contiguous()``
copy is made first.

``use_triton(t)`` decides: CUDA tensor and triton importable, or ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, used by the tests). Otherwise callers fall back to the plain-torch reference.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch.library import triton_op

from loka_trainer.kernels import pdl
from loka_trainer.kernels.quant import EPS, quantize_rowwise
from loka_trainer.kernels.triton_env import interpreting, launcher, use_triton


def fixed_or_autotuned(kernel, config: Optional[dict], interpreter_config: dict) -> tuple[Any, dict]:
    """(launchable, launch keywords) of a ``triton.autotune``d kernel: ``kernel.fn`` with ``config`` when one is
    given, or with ``interpreter_config`` under the interpreter (which cannot time configs); else the autotuner."""
    if config is None and interpreting():
        config = interpreter_config
    return (kernel, {}) if config is None else (kernel.fn, dict(config))


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t (R, C) with unit column stride, as the Triton kernels read it (a copy only when it has another)."""
    return t if t.stride(1) == 1 else t.contiguous()


def scale_vector(s: torch.Tensor) -> torch.Tensor:
    """Per-row or per-column scales (R,)/(R, 1)/(1, R) -> (R,) fp32 contiguous, as the Triton kernels read them."""
    return s.reshape(-1).float().contiguous()


@functools.lru_cache(maxsize=1)
def _kernel():
    """Import the kernel once (importing triton there, never at this module's import)."""
    import triton

    from loka_trainer.kernels.triton_quant_kernels import quant_rowwise_kernel
    return triton, quant_rowwise_kernel


# A row-major row up to this long is quantized from one tile held in registers (read once); longer rows
# loop over 512-wide chunks twice (amax, then cast; the second read mostly from L2).
SINGLE_PASS_MAX_COLS = 8192


def _tile(R: int, C: int, row_major: bool) -> tuple[int, int, bool, int]:
    """(ROWS, COLS, single_pass, warps) per program.

    Row-major t with C <= SINGLE_PASS_MAX_COLS: whole rows, ROWS = 2048 // C' (at least 1, C' = C rounded up
    to a power of two), one read, 4 warps. On the H200 (M = 1024, ``benchmarks/sweep_memory_kernels.py``) this
    took 2.2-3.0 µs at C = 2048-4096 and 1.0-1.2 µs at C = 256-512, against 2.4-3.3 and 1.23-1.33 µs with
    ~4K-element tiles on 8 warps; a two-pass 8 x 512 tile took 16.2 µs for a (1024, 7680) bf16 t and 9.6 µs for
    (1024, 4096) (only R / 8 = 128 programs: latency-bound). Longer rows: 512 wide, two passes.
    A transposed view (t = a.t(), contiguous along R): 16 rows (one 32-byte sector of each row of ``a``) by
    256 along C, so (R / 16) programs fill the GPU. On the H200 this took quant(a.t()) for a (1024, C) bf16
    from 16.4 / 16.7 / 19.2 µs (64 x 64 tiles) to 5.5 / 8.2 / 12.3 µs at C = 2048 / 4096 / 7680.
    """
    import triton
    if row_major:
        whole = triton.next_power_of_2(C)
        if whole <= SINGLE_PASS_MAX_COLS:
            return max(1, min(triton.next_power_of_2(R), 2048 // whole)), whole, True, 4
        rows, cols = max(1, min(triton.next_power_of_2(R), 4096 // 512)), 512
    else:
        rows, cols = min(triton.next_power_of_2(R), 16), min(triton.next_power_of_2(C), 256)
    return rows, cols, False, 8 if rows * cols >= 4096 else 4


def quantize_rowwise_fused(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) any strides -> (q (R, C) fp8 contiguous, scale_inv (R, 1) fp32); reference off-Triton."""
    if not use_triton(t):
        q, s = quantize_rowwise(t, dtype)
        return q.contiguous(), s
    triton, kernel = _kernel()
    R, C = t.shape
    q = torch.empty((R, C), dtype=dtype, device=t.device)
    s = torch.empty((R, 1), dtype=torch.float32, device=t.device)
    rows, cols, single_pass, warps = _tile(R, C, row_major=t.stride(1) == 1)
    launcher(kernel, t)[(triton.cdiv(R, rows),)](
        t, q, s, R, C, t.stride(0), t.stride(1), q.stride(0), FP8_MAX=torch.finfo(dtype).max, EPS_=EPS, ROWS=rows,
        COLS=cols, SINGLE_PASS=single_pass, num_warps=warps, **pdl.launch_args(t))
    return q, s


@triton_op("loka::quant_rowwise", mutates_args=())
def quant_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``quantize_rowwise_fused`` as a ``triton_op``: eager, one op; compiled, inductor launches the one kernel
    from its own code (14 µs of host time per call on the H200 against 61 µs as a ``custom_op``,
    ``benchmarks/quant_op_host_time_gpu.py``)."""
    return quantize_rowwise_fused(t, torch.float8_e4m3fn)
