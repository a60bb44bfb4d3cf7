"""Draw synthetic GEMM operands from learned statistics (LoKA III-A, offline phase).

Activations (rows independent): T' = 1 mu^T + Z L_S^T with L_S L_S^T = S + eps I, per covariance block.
  Z: (B, K) standard normal; with a block-diagonal representation each block is sampled independently.
Weights (matrix normal):        W' = M + L_U Z L_V^T,  Z: (O, I) standard normal.
All sampling is in the stats dtype (fp64 in files) and the caller casts.
"""
from __future__ import annotations

from typing import Optional

import torch

from loka_trainer.probe.activation import Moments, block_covariance
from loka_trainer.probe.weight import cholesky_factor


@torch.no_grad()
def activation_factor(m: Moments) -> torch.Tensor:
    """Per-block Cholesky factors of the covariance + eps I: (G, Kb, Kb).

    Padded features of the last block have zero variance; the relative jitter keeps the factorization valid
    and those features are cut off after sampling.
    """
    blocks = block_covariance(m)  # (G, Kb, Kb)
    return torch.stack([cholesky_factor(b) for b in blocks.unbind(0)])


@torch.no_grad()
def sample_activations(m: Moments, num_rows: int, *, generator: Optional[torch.Generator] = None,
                       factor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """T' ~ N(mu, Sigma) row-wise: (B, K). ``factor`` from activation_factor() may be reused across draws."""
    factor = activation_factor(m) if factor is None else factor
    num_blocks, block, _ = factor.shape
    z = torch.randn(num_rows, num_blocks, block, generator=generator, dtype=factor.dtype,
                    device=factor.device)  # (B, G, Kb)
    x = torch.einsum("bgj,gij->bgi", z, factor).reshape(num_rows, num_blocks * block)
    return x[:, : m.num_features] + m.mean.to(x)


@torch.no_grad()
def weight_factors(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_U, L_V): full (n, n) or diagonal (n,) Cholesky factors of U + eps I and V + eps I."""
    return cholesky_factor(u), cholesky_factor(v)


@torch.no_grad()
def sample_weight(mean: torch.Tensor, lu: torch.Tensor, lv: torch.Tensor, *,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """W' = M + L_U Z L_V^T. mean: (O, I); lu: (O, O)|(O,); lv: (I, I)|(I,) -> (O, I)."""
    z = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)  # (O, I)
    z = lu.unsqueeze(1) * z if lu.ndim == 1 else lu @ z
    z = z * lv if lv.ndim == 1 else z @ lv.T
    return mean + z
