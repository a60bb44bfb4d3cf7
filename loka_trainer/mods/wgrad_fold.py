"""A weight grad on tensorwise FP8 that reuses the forward's rowwise FP8 x: the row scales fold into dz.

Notation: M rows (the weight grad's contraction dim), K in-features, N out-features; dz (M, N) bf16, the forward's
x ≈ xq · sx with xq (M, K) e4m3 and sx (M, 1) fp32 (``quant_rowwise``, or the previous layer's FP8 output).

    dW[n, k] = Σ_m dz[m, n] · x[m, k] ≈ Σ_m (dz[m, n] · sx[m]) · xq[m, k]

so dW = (dz·sx)ᵀ · xq exactly, with sx moved from x (where it varies along the contraction, which no FP8 GEMM
can scale) onto dz. dz·sx is then quantized tensorwise e5m2 (one scalar scale) and the GEMM is cuBLASLt's
tensorwise FP8 one. FP8 GEMMs on Hopper read both operands contiguous along the contraction, so both go in
transposed: (dz·sx)ᵀ (N, M) and xqᵀ (K, M).

Where the operands come from: ``wgrad_fold`` makes them from the bf16 dz (an amax pass over dz·sx, then one
launch writing both transposes); behind a fused FP8 dgrad the dz kernels make (dz·sx)ᵀ (``triton_mods.
backward_dz_fp8(fold_sx=)``) and ``wgrad_folded_dz`` only transposes xq. Measured on the H200: the FP8 GEMM saves
7-11 µs over the BF16 one at the four large figure-13 shapes; with the backward's FP8 GEMMs on fast accumulation
the layer with the folded weight grad is the fastest mode at (4096, 2048), (4096, 2560) and (2048, 4096), and
slower at the small shapes (docs/kernels/README.md, "The current layer table"). Writing xqᵀ in the forward's
quantization of x instead (a two-launch quantizer) made it 1-10 µs slower; separate transposed quantizers of x and
dz cost 15.6 µs at (K, N) = (4096, 2048), M = 1024 (CHANGELOG.md, "Tried and reverted").

Numerics against the ``scaled_mm_tensorwise`` backend's weight grad (xᵀ tensorwise e4m3, dzᵀ tensorwise
e5m2): x keeps the forward's finer rowwise scales, and dz's tensorwise scale covers dz·sx instead of dz
(``tests/kernels/test_wgrad_fold.py`` compares the two errors).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.library import triton_op

from loka_trainer.kernels import pdl
from loka_trainer.kernels.backends_scaled_mm import scaled_mm_nt
from loka_trainer.kernels.quant import EPS, quantize_tensorwise
from loka_trainer.kernels.triton_env import launcher, traced, use_triton
from loka_trainer.kernels.triton_quant import rows_contiguous, scale_vector

DZ_DTYPE = torch.float8_e5m2  # a gradient operand, as the tensorwise backend's
BLOCK_R, BLOCK_C = 64, 64  # a transposed store writes 64 contiguous bytes of each output row


@functools.lru_cache(maxsize=None)
def _unit_scale_on(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def unit_scale(like: torch.Tensor) -> torch.Tensor:
    """A () fp32 one on ``like``'s device: the scale of an FP8 operand whose scales are applied elsewhere (xq here,
    its row scales in dz's operand; the split FP8 forward's operands, their scales in the epilogue). Made once per
    device, except in a traced graph, which cannot hold a tensor made outside it."""
    if traced(like):
        return torch.ones((), dtype=torch.float32, device=like.device)
    return _unit_scale_on(like.device)


@torch.no_grad()
def fold_dz_ref(dz: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dz (M, N), sx (M, 1) -> (dzt (N, M) e5m2 = (dz·sx)ᵀ quantized tensorwise, its scale_inv () fp32)."""
    q, s = quantize_tensorwise(dz.float() * sx.reshape(-1, 1), DZ_DTYPE)
    return q.t().contiguous(), s


def fold_operands_ref(dz: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dz (M, N), xq (M, K), sx (M, 1) -> (dzt (N, M) e5m2, its scale_inv () fp32, xqt (K, M) e4m3)."""
    return (*fold_dz_ref(dz, sx), xq.t().contiguous())


def _launch_fold_transpose(dz: Optional[torch.Tensor], sx: Optional[torch.Tensor], amax: Optional[torch.Tensor],
                           xq: Optional[torch.Tensor]) -> tuple:
    """One ``fold_transpose_kernel`` launch writing (dzt, s) from dz (M, N), sx, amax (when dz is given) and
    xqt from xq (M, K) (when xq is given): ((dzt, s) or None, xqt or None)."""
    import triton

    from loka_trainer.mods import triton_wgrad_fold_kernels as k
    ref = dz if dz is not None else xq
    M, dev = ref.shape[0], ref.device
    N, K = (dz.shape[1] if dz is not None else 0), (xq.shape[1] if xq is not None else 0)
    s = torch.empty((), dtype=torch.float32, device=dev)  # also stands in for the pointers not used
    dzt = torch.empty((N, M), dtype=DZ_DTYPE, device=dev) if dz is not None else None
    xqt = torch.empty((K, M), dtype=xq.dtype, device=dev) if xq is not None else None
    tiles = triton.cdiv(M, BLOCK_R) * (triton.cdiv(N, BLOCK_C) + triton.cdiv(K, BLOCK_C))
    given = lambda t: t if t is not None else s  # noqa: E731
    launcher(k.fold_transpose_kernel, ref)[(tiles,)](
        given(dz), given(sx), given(amax), given(dzt), s, given(xq), given(xqt), M, N, K,
        dz.stride(0) if dz is not None else 0, xq.stride(0) if xq is not None else 0,
        amax.numel() if amax is not None else 0, FP8_MAX=torch.finfo(DZ_DTYPE).max, EPS_=EPS, BLOCK_R=BLOCK_R,
        BLOCK_C=BLOCK_C, **pdl.launch_args(ref))
    return ((dzt, s) if dz is not None else None), xqt


def fold_dz_with_amax(dz: torch.Tensor, sx: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dz (M, N) bf16, sx (M,)/(M, 1) fp32, amax fp32 with max(amax) = max |dz·sx| (found by the kernel that wrote
    dz: its tile maxima, or one scalar) -> (dzt (N, M) e5m2, scale_inv ()): ``fold_operands_ref``'s first two
    (Triton)."""
    return _launch_fold_transpose(rows_contiguous(dz), scale_vector(sx), amax, None)[0]


def transpose_fp8(xq: torch.Tensor) -> torch.Tensor:
    """xq (M, K) fp8 -> xqᵀ (K, M) contiguous (Triton; ``.t().contiguous()`` off-Triton)."""
    if not use_triton(xq):
        return xq.t().contiguous()
    return _launch_fold_transpose(None, None, None, rows_contiguous(xq))[1]


def fold_operands(dz: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fold_operands_ref`` in two Triton launches (amax of dz·sx, then both transposed writes); the reference
    off-Triton."""
    if not use_triton(dz):
        return fold_operands_ref(dz, xq, sx)
    import triton

    from loka_trainer.mods import triton_wgrad_fold_kernels as k
    M, N = dz.shape
    dz, sx = rows_contiguous(dz), scale_vector(sx)
    amax = torch.zeros((), dtype=torch.float32, device=dz.device)
    launcher(k.fold_amax_kernel, dz)[(triton.cdiv(M, BLOCK_R) * triton.cdiv(N, BLOCK_C),)](
        dz, sx, amax, M, N, dz.stride(0), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, **pdl.launch_args(dz))
    (dzt, s), xqt = _launch_fold_transpose(dz, sx, amax, rows_contiguous(xq))
    return dzt, s, xqt


@triton_op("loka::wgrad_fold", mutates_args=())
def wgrad_fold(dz: torch.Tensor, xq: torch.Tensor, sx: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """dz (M, N) bf16, xq (M, K) e4m3, sx (M, 1) fp32 -> dW = dzᵀ·(xq·sx) (N, K) bf16 on tensorwise FP8 (module
    docstring), on the fast-accumulation GEMM when ``fast_accum``; M, K, N % 16 == 0 (``torch._scaled_mm``)."""
    dzt, s, xqt = fold_operands(dz, xq, sx)
    return scaled_mm_nt(dzt, s, xqt, unit_scale(dz), fast_accum)


@triton_op("loka::wgrad_folded_dz", mutates_args=())
def wgrad_folded_dz(dzt: torch.Tensor, s: torch.Tensor, xq: torch.Tensor, fast_accum: bool = False) -> torch.Tensor:
    """dzt (N, M) e5m2 = (dz·sx)ᵀ at scale_inv s () (written by the dz kernels, ``triton_mods.backward_dz_fp8``),
    xq (M, K) e4m3 -> dW (N, K) bf16: ``wgrad_fold`` with its dz operand already made."""
    return scaled_mm_nt(dzt, s, transpose_fp8(xq), unit_scale(dzt), fast_accum)
