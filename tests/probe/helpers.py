"""Synthetic data with known moments for the probe tests."""
from __future__ import annotations

import torch

DT = torch.float64


def random_spd(n: int, *, gen: torch.Generator, ridge: float = 0.2) -> torch.Tensor:
    """A well-conditioned SPD (n, n) matrix."""
    a = torch.randn(n, n, generator=gen, dtype=DT)
    return a @ a.T / n + ridge * torch.eye(n, dtype=DT)


def gaussian_rows(num_rows: int, mean: torch.Tensor, cov: torch.Tensor, *, gen: torch.Generator) -> torch.Tensor:
    """(num_rows, K) rows ~ N(mean, cov)."""
    chol = torch.linalg.cholesky(cov)
    return mean + torch.randn(num_rows, mean.numel(), generator=gen, dtype=DT) @ chol.T


def outlier_activations(num_rows: int, num_features: int, *, gen: torch.Generator,
                        outliers: tuple[int, ...], scale: float = 40.0) -> torch.Tensor:
    """Realistic-looking activations: positive mean, correlated, a few outlier features with large scale."""
    mean = 0.5 + 0.2 * torch.rand(num_features, generator=gen, dtype=DT)
    x = gaussian_rows(num_rows, mean, random_spd(num_features, gen=gen), gen=gen)
    x[:, list(outliers)] *= scale
    return x


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b."""
    return float((a - b).norm() / b.norm())
