"""Rowwise FP8 quantization that also writes the transposed copy: t (R, C) -> q (R, C), qᵀ (C, R), scale_inv (R, 1).

Why: the folded FP8 weight grad (``wgrad_fold``) reads the forward's FP8 x transposed, (K, M), because FP8 GEMMs
on Hopper read both operands contiguous along the contraction (M there). Writing xqᵀ while x is quantized in
the forward replaces a transpose launch in the backward, which re-read xq (on the H200 at (K, N) = (4096,
2560), M = 1024: the quantization kernel 4.6-5.8 µs and that transpose 3.7 µs, docs/kernels/README.md).

How: two launches over (ROWS, COLS) tiles, so that a transposed store writes ROWS contiguous bytes of a qᵀ row:
``row_amax_kernel`` stores each row's max |t| per column chunk (no atomics, nothing to zero first), then
``quant_rowwise_t_kernel`` takes the row max over the chunks, casts its tile once and stores it twice. The
second launch re-reads t, mostly from L2. Same math as ``quant.quantize_rowwise`` (EPS clamp, saturating cast).
"""
from __future__ import annotations

import functools

import torch

from loka_trainer.kernels import pdl
from loka_trainer.kernels.quant import EPS, quantize_rowwise
from loka_trainer.kernels.triton_quant import use_triton

TILE_ROWS, TILE_COLS = 64, 128  # 64-byte runs of each qᵀ row per store; 16 x (C / 128) programs at R = 1024


@functools.lru_cache(maxsize=1)
def _kernels():
    """Import the kernels once (importing triton there, never at this module's import)."""
    import triton

    from loka_trainer.kernels import triton_quant_kernels as k
    return triton, k.row_amax_kernel, k.quant_rowwise_t_kernel


def quantize_rowwise_transposed_ref(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """t (R, C) -> (q (R, C) fp8, scale_inv (R, 1) fp32, qt (C, R) fp8 = qᵀ contiguous), in torch."""
    q, s = quantize_rowwise(t, dtype)
    q = q.contiguous()
    return q, s, q.t().contiguous()


def quantize_rowwise_transposed(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rowwise_transposed_ref`` in two Triton launches (module docstring); the reference off-Triton."""
    if not use_triton(t):
        return quantize_rowwise_transposed_ref(t, dtype)
    triton, amax_kernel, cast_kernel = _kernels()
    t = t if t.stride(1) == 1 else t.contiguous()
    R, C = t.shape
    grid = (triton.cdiv(R, TILE_ROWS), triton.cdiv(C, TILE_COLS))
    amax = torch.empty((R, grid[1]), dtype=torch.float32, device=t.device)
    q = torch.empty((R, C), dtype=dtype, device=t.device)
    qt = torch.empty((C, R), dtype=dtype, device=t.device)
    s = torch.empty((R, 1), dtype=torch.float32, device=t.device)
    amax_kernel[grid](t, amax, R, C, t.stride(0), ROWS=TILE_ROWS, COLS=TILE_COLS, **pdl.launch_args(t))
    cast_kernel[grid](t, amax, q, qt, s, R, C, t.stride(0), FP8_MAX=torch.finfo(dtype).max, EPS_=EPS,
                      ROWS=TILE_ROWS, COLS=TILE_COLS, CHUNKS_P2=triton.next_power_of_2(grid[1]), num_warps=8,
                      **pdl.launch_args(t))
    return q, s, qt


@torch.library.custom_op("loka::quant_rowwise_t", mutates_args=())
def quant_rowwise_t(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 ``quantize_rowwise_transposed`` as a custom op (opaque to torch.compile: the two kernels stay two)."""
    return quantize_rowwise_transposed(t, torch.float8_e4m3fn)


@quant_rowwise_t.register_fake
def _(t):
    R, C = t.shape
    return (t.new_empty((R, C), dtype=torch.float8_e4m3fn), t.new_empty((R, 1), dtype=torch.float32),
            t.new_empty((C, R), dtype=torch.float8_e4m3fn))
