"""Tensorwise FP8 quantization in two Triton kernels: tile amaxes -> one atomic max, then one cast pass.

Notation: t (R, C) any 2-D view (e.g. ``dy.t()`` for the weight-grad GEMM). ``quantize_tensorwise_fused(t,
dtype)`` returns q (R, C) contiguous fp8 and scale_inv () fp32 with ``t ≈ q * scale_inv`` — the math of
``quant.quantize_tensorwise`` (EPS clamp, saturating cast), so it is a drop-in for it.

Why: the eager chain (abs, amax, clamp, div, float, mul, clamp, cast) makes ~5 passes over t with fp32
temporaries; on the H200 it made ``scaled_mm_tensorwise`` 4.2x slower than BF16 at 8192x2048x2048 with
quantization included (suite (a) of docs/kernels/README.md "Measured limits"). Here both kernels tile t along its
contiguous dim (a transposed view is read with its own strides, no ``.contiguous()`` copy) and each reads t once.
"""
from __future__ import annotations

import functools

import torch
from torch.library import triton_op

from loka_trainer.kernels import pdl
from loka_trainer.kernels.quant import EPS, quantize_tensorwise
from loka_trainer.kernels.triton_env import launcher, use_triton

TILE_WIDE, TILE_NARROW = 256, 16  # elements along t's contiguous dim, and along the other


@functools.lru_cache(maxsize=1)
def _kernels():
    """Import the kernels once (importing triton there, never at this module's import)."""
    import triton

    from loka_trainer.kernels import triton_quant_tensorwise_kernels as k
    return triton, k.amax_kernel, k.cast_kernel


def _tiles(t: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): wide along t's contiguous dim (unit stride), narrow along the other."""
    return (TILE_NARROW, TILE_WIDE) if t.stride(1) == 1 else (TILE_WIDE, TILE_NARROW)


def quantize_tensorwise_fused(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) any strides -> (q (R, C) fp8 contiguous, scale_inv () fp32); reference off-Triton."""
    if not use_triton(t):
        q, s = quantize_tensorwise(t, dtype)
        return q.contiguous(), s
    triton, amax_kernel, _ = _kernels()
    R, C = t.shape
    amax = torch.zeros((), dtype=torch.float32, device=t.device)
    block_r, block_c = _tiles(t)
    launcher(amax_kernel, t)[(triton.cdiv(R, block_r) * triton.cdiv(C, block_c),)](
        t, amax, R, C, t.stride(0), t.stride(1), BLOCK_R=block_r, BLOCK_C=block_c, **pdl.launch_args(t))
    return cast_with_amax(t, amax, dtype)


def cast_with_amax(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) any strides, amax fp32 with max(amax) = max |t| (found elsewhere, e.g. by the kernel that wrote t:
    one scalar, or that kernel's tile maxima) -> (q (R, C) fp8 contiguous, scale_inv () fp32): the cast pass of
    ``quantize_tensorwise_fused`` (Triton)."""
    triton, _, cast_kernel = _kernels()
    R, C = t.shape
    q = torch.empty((R, C), dtype=dtype, device=t.device)
    s = torch.empty((), dtype=torch.float32, device=t.device)
    block_r, block_c = _tiles(t)
    launcher(cast_kernel, t)[(triton.cdiv(R, block_r) * triton.cdiv(C, block_c),)](
        t, amax, q, s, R, C, t.stride(0), t.stride(1), amax.numel(), FP8_MAX=torch.finfo(dtype).max, EPS_=EPS,
        BLOCK_R=block_r, BLOCK_C=block_c, **pdl.launch_args(t))
    return q, s


@triton_op("loka::quant_tensorwise", mutates_args=())
def quant_tensorwise(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tensorwise_fused`` as a ``triton_op`` (compiled, inductor launches its two kernels itself)."""
    return quantize_tensorwise_fused(t, dtype)
