"""FP8 quantization recipes: amax -> scale -> cast, in plain torch (runs on CPU; the reference for Triton).

Notation: M rows (batch), K columns (the GEMM contraction dim for a row-major operand), G = ceil(K / 128).

Convention (the one ``torch._scaled_mm`` uses): ``quantize`` returns ``(q, scale_inv)`` with
``x ≈ q.float() * scale_inv`` broadcast over the granularity's groups, so ``scale_inv`` is what the GEMM
multiplies its accumulator by. Granularities:

- ``tensorwise``:  scale_inv ()          one scale for the tensor
- ``rowwise``:     scale_inv (M, 1)      one scale per row (amax over the last dim)
- ``colwise``:     scale_inv (1, K)      one scale per column (amax over dim 0; weight-grad operands)
- ``block1x128``:  scale_inv (M, G)      one scale per row and 128-wide group of the last dim
- ``block128x128``: scale_inv (ceil(M/128), G)  one scale per 128×128 tile
"""
from __future__ import annotations

from typing import Callable

import torch

# NOTE: amax is clamped below by EPS before dividing, so an all-zero group gets a finite (large) scale and
# quantizes to exact zeros; subnormal-only groups likewise. torchao's float8 utilities and our Triton kernels use
# this value.
EPS = 1e-12
BLOCK = 128

FP8_DTYPES: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}


def fp8_dtype(name: str) -> torch.dtype:
    """Name ('e4m3' | 'e5m2') -> torch dtype; unknown name -> ValueError listing the valid ones."""
    if name not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype: unknown {name!r}; valid: {sorted(FP8_DTYPES)}")
    return FP8_DTYPES[name]


@torch.no_grad()
def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """amax (any shape, >= 0) -> fp32 scale of the same shape with ``x * scale`` filling the FP8 range.

    torchao's ``amax_to_scale`` (the quotient in fp64, rounded once to fp32: what an exact fp32 division gives),
    with amax also clamped to the fp32 max so that an inf amax gets a finite scale (torchao's would be 0).
    """
    # NOTE: torchao is imported on first use: its import takes seconds, and the CLI's config check imports this module.
    from torchao.float8.float8_utils import amax_to_scale as torchao_amax_to_scale  # noqa: PLC0415

    return torchao_amax_to_scale(amax.to(torch.float32).clamp(max=torch.finfo(torch.float32).max), dtype)


@torch.no_grad()
def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: (x * scale) clamped to the FP8 range, so rounding can never produce inf/NaN (torchao's)."""
    from torchao.float8.float8_utils import to_fp8_saturated  # noqa: PLC0415 -- imported on first use, as above

    return to_fp8_saturated(x.to(torch.float32) * scale, dtype)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad ``dim`` of a 2-D tensor up to a multiple (zeros never raise an amax)."""
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    pads = [0, pad, 0, 0] if dim in (1, -1) else [0, 0, 0, pad]
    return torch.nn.functional.pad(x, pads)


@torch.no_grad()
def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) fp8, scale_inv () fp32."""
    scale = amax_to_scale(x.abs().amax(), dtype)
    return cast_to_fp8(x, scale, dtype), scale.reciprocal()


@torch.no_grad()
def quantize_rowwise(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) fp8, scale_inv (M, 1) fp32."""
    scale = amax_to_scale(x.abs().amax(dim=-1, keepdim=True), dtype)
    return cast_to_fp8(x, scale, dtype), scale.reciprocal()


@torch.no_grad()
def quantize_colwise(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) fp8, scale_inv (1, K) fp32 (amax over rows: for GEMMs contracting over M)."""
    scale = amax_to_scale(x.abs().amax(dim=0, keepdim=True), dtype)
    return cast_to_fp8(x, scale, dtype), scale.reciprocal()


@torch.no_grad()
def quantize_block1x128(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) fp8, scale_inv (M, G) fp32, G = ceil(K/128)."""
    m, k = x.shape
    xp = _pad_to(x, 1, BLOCK)  # (M, G*128)
    groups = xp.reshape(m, -1, BLOCK)  # (M, G, 128)
    scale = amax_to_scale(groups.abs().amax(dim=-1), dtype)  # (M, G)
    q = cast_to_fp8(groups, scale.unsqueeze(-1), dtype).reshape(m, -1)[:, :k]
    return q, scale.reciprocal()


@torch.no_grad()
def quantize_block128x128(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K) fp8, scale_inv (ceil(M/128), G) fp32."""
    m, k = x.shape
    xp = _pad_to(_pad_to(x, 1, BLOCK), 0, BLOCK)  # (Mb*128, G*128)
    mb, g = xp.shape[0] // BLOCK, xp.shape[1] // BLOCK
    tiles = xp.reshape(mb, BLOCK, g, BLOCK)  # (Mb, 128, G, 128)
    scale = amax_to_scale(tiles.abs().amax(dim=(1, 3)), dtype)  # (Mb, G)
    q = cast_to_fp8(tiles, scale[:, None, :, None], dtype).reshape(mb * BLOCK, g * BLOCK)[:m, :k]
    return q, scale.reciprocal()


QUANTIZERS: dict[str, Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]]] = {
    "tensorwise": quantize_tensorwise,
    "rowwise": quantize_rowwise,
    "colwise": quantize_colwise,
    "block1x128": quantize_block1x128,
    "block128x128": quantize_block128x128,
}


def quantize(x: torch.Tensor, granularity: str, dtype: torch.dtype = torch.float8_e4m3fn):
    """x (M, K) -> (q (M, K) fp8, scale_inv); see the module docstring for the scale_inv shape."""
    if granularity not in QUANTIZERS:
        raise ValueError(f"granularity: unknown {granularity!r}; valid: {sorted(QUANTIZERS)}")
    return QUANTIZERS[granularity](x, dtype)


@torch.no_grad()
def expand_scale(scale_inv: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """scale_inv of any granularity -> (M, K) fp32, each element's dequantization multiplier."""
    m, k = shape
    if scale_inv.dim() == 0 or scale_inv.shape in ((m, 1), (1, k)):
        return scale_inv.expand(m, k)
    rows = BLOCK if scale_inv.shape[0] != m else 1
    return scale_inv.repeat_interleave(rows, 0).repeat_interleave(BLOCK, 1)[:m, :k]


@torch.no_grad()
def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """q (M, K) fp8 and its scale_inv -> (M, K) fp32."""
    return q.to(torch.float32) * expand_scale(scale_inv, tuple(q.shape))


@torch.no_grad()
def fake_quantize(x: torch.Tensor, granularity: str, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x (M, K) -> (M, K) fp32: quantize then dequantize (the numerics an FP8 GEMM input sees)."""
    return dequantize(*quantize(x, granularity, dtype))
