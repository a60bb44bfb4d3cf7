"""Plain-torch reference of the LoKA Mods layer math (the Triton fused kernel is tested against this).

Notation: M rows, K in-features, N out-features, B the BlockNorm block (default 256).

- BlockNorm: RMSNorm without affine over contiguous B-wide blocks of the last dim. When N is not a multiple
  of B the last, shorter block is normalized over its own width (so block = N is plain RMSNorm).
- HardSwish: h(z) = z · ReLU6(z + 3) / 6.
- Bound: every full block has RMS 1, so |z| <= sqrt(B) (16 for B = 256) and h(z) in [-0.375, sqrt(B)]; the
  fused kernel uses it to write the next layer's FP8 input with the static scale fp8_max / sqrt(B).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from loka_trainer.mods.layers import block_rms_norm

DEFAULT_BLOCK = 256
DEFAULT_EPS = 1e-6


def block_norm(z: torch.Tensor, block: int = DEFAULT_BLOCK, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """z (..., N) -> (..., N) in z's dtype, each B-wide block scaled to RMS 1 (statistics in fp32): the model's
    ``BlockNorm`` math (one reshape, not a slice per block: what ``torch.compile`` of the Mods sees in a model)."""
    return block_rms_norm(z.float(), block, eps).to(z.dtype)


def hard_swish(z: torch.Tensor) -> torch.Tensor:
    """z (...) -> z · ReLU6(z + 3) / 6, same shape and dtype."""
    return z * (z + 3.0).clamp(0.0, 6.0) / 6.0


def static_fp8_scale(block: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """The static quantization scale for BlockNorm→HardSwish outputs: fp8_max / sqrt(block)."""
    return torch.finfo(dtype).max / math.sqrt(block)


def linear_mods_ref(x: torch.Tensor, w: torch.Tensor, block: int = DEFAULT_BLOCK,
                    eps: float = DEFAULT_EPS) -> torch.Tensor:
    """x (M, K), w (N, K) -> HardSwish(BlockNorm(x·Wᵀ)) (M, N) in fp32 (differentiable)."""
    return hard_swish(block_norm(x.float() @ w.float().t(), block, eps))


@torch.no_grad()
def fp8_linear_mods_ref(xq: torch.Tensor, x_scale_inv: torch.Tensor, wq: torch.Tensor, w_scale_inv: torch.Tensor,
                        block: int = DEFAULT_BLOCK, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """FP8 inputs with rowwise scales: xq (M, K), x_scale_inv (M, 1), wq (N, K), w_scale_inv (N, 1) -> (M, N) fp32."""
    x = xq.float() * x_scale_inv.reshape(-1, 1)
    w = wq.float() * w_scale_inv.reshape(-1, 1)
    return linear_mods_ref(x, w, block, eps)


@torch.no_grad()
def quantize_static(h: torch.Tensor, block: int = DEFAULT_BLOCK,
                    dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Mods output h (M, N) -> (q (M, N) fp8, scale_inv () fp32) with the static bound scale (no amax pass)."""
    scale = static_fp8_scale(block, dtype)
    fp8_max = torch.finfo(dtype).max
    q = (h.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return q, torch.tensor(1.0 / scale, device=h.device)


@torch.no_grad()
def mods_forward_ref(z: torch.Tensor, block: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z (M, N) fp32 -> (h (M, N) bf16, u (M, N) bf16, r (M, NB) fp32), the kernels' plain-torch twin."""
    zb = z.float().unflatten(-1, (-1, block))  # (M, NB, B)
    r = torch.rsqrt(zb.square().mean(-1) + eps)  # (M, NB)
    u = (zb * r.unsqueeze(-1)).flatten(-2)
    return hard_swish(u).to(torch.bfloat16), u.to(torch.bfloat16), r


@torch.no_grad()
def u_from_z(z: torch.Tensor, r: torch.Tensor, block: int, row_scale: Optional[torch.Tensor] = None,
             col_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """z (M, N), r (M, NB) fp32, optional row_scale (M,)/(M, 1) and col_scale (N,)/(N, 1) -> u (M, N) fp32 =
    z·row_scale·col_scale·r (r per norm block): the u of a forward that kept z instead of u."""
    zf = z.float()
    if row_scale is not None:
        zf = zf * row_scale.reshape(-1, 1).float() * col_scale.reshape(1, -1).float()
    return (zf.unflatten(-1, (-1, block)) * r.unsqueeze(-1)).flatten(-2)


@torch.no_grad()
def mods_backward_ref(dh: torch.Tensor, u: torch.Tensor, r: torch.Tensor, block: int) -> torch.Tensor:
    """dh (M, N), u (M, N), r (M, NB) -> dz (M, N) bf16: g = dh·HardSwish'(u), dz = r·(g − u·mean_B(g·u))."""
    uf = u.float()
    slope = torch.where(uf < -3, 0.0, torch.where(uf > 3, 1.0, (2 * uf + 3) / 6))
    g = (dh.float() * slope).unflatten(-1, (-1, block))  # (M, NB, B)
    ub = uf.unflatten(-1, (-1, block))
    dz = r.unsqueeze(-1) * (g - ub * (g * ub).mean(-1, keepdim=True))
    return dz.flatten(-2).to(torch.bfloat16)
