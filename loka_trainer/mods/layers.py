"""The two LoKA Mods layers a model is built with: BlockNorm (paper III-B2) and HardSwish (paper III-B3).

Notation: N features of the last dim, b block size. Any leading dims.
"""
from __future__ import annotations

import torch
from torch import nn


EPS = 1e-6


def block_rms_norm(x: torch.Tensor, block_size: int, eps: float = EPS) -> torch.Tensor:
    """RMS-normalize ``x`` over contiguous blocks of its last dim, one statistic per block.

    x: (..., N) -> (..., N). Blocks are ``[0, b), [b, 2b), ...``; when ``N % b != 0`` the last block
    holds the remaining ``N % b`` features and gets its own statistic (see ``BlockNorm``).
    Differentiable (not ``no_grad``): it is the forward of a training layer.
    """
    num_features = x.shape[-1]
    num_full = num_features // block_size
    parts = []
    if num_full:
        full = x[..., : num_full * block_size].unflatten(-1, (num_full, block_size))  # (..., nb, b)
        parts.append((full * torch.rsqrt(full.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2))
    if num_features % block_size:
        tail = x[..., num_full * block_size :]  # (..., N % b)
        parts.append(tail * torch.rsqrt(tail.pow(2).mean(-1, keepdim=True) + eps))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class BlockNorm(nn.Module):
    """RMSNorm over fixed blocks of ``block_size`` features (LoKA Mods, paper III-B2).

    Equals an unparameterized grouped RMSNorm; equals plain RMSNorm (no affine) when
    ``block_size >= num_features``. Identical in train and eval (no running statistics).

    Rule when ``num_features % block_size != 0``: the last block is ragged (it holds the
    ``num_features % block_size`` remaining features and has its own statistic). This is exactly
    what a fused GEMM epilogue with N tile = block computes on its masked edge tile, so the fused
    kernel and this reference agree for every width, and widths like 27 * 24 = 648 (Wukong FMB)
    need no padding. A very small last block is a weak statistic: prefer widths that are multiples.

    x: (..., num_features) -> (..., num_features)
    """

    def __init__(
        self, num_features: int, block_size: int = 256, eps: float = EPS, elementwise_affine: bool = False
    ) -> None:
        super().__init__()
        if block_size <= 0:
            raise ValueError(f"BlockNorm: block_size must be positive, got {block_size}")
        self.num_features = num_features
        self.block_size = block_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = block_rms_norm(x, self.block_size, self.eps)
        return y if self.weight is None else y * self.weight

    def extra_repr(self) -> str:
        return f"{self.num_features}, block_size={self.block_size}, affine={self.weight is not None}"


class HardSwish(nn.Hardswish):
    """Hard Swish ``x * ReLU6(x + 3) / 6`` (LoKA Mods, paper III-B3): Swish without an exponential.

    Subclasses ``nn.Hardswish`` so code that looks for the stock class finds it. (..., N) -> (..., N)
    """
