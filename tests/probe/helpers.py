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


def kron_distance(u: torch.Tensor, v: torch.Tensor, u_true: torch.Tensor,
                  v_true: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius distance of U⊗V from U*⊗V* at the best scale, ‖U⊗V‖ / ‖U*⊗V*‖) for full (n, n)
    factors, without forming the Kronecker products: <A⊗B, C⊗D> = <A, C><B, D> and ‖A⊗B‖ = ‖A‖‖B‖, so
    min_c ‖c X − Y‖ / ‖Y‖ = sqrt(1 − cos²) with cos = cos(U, U*) cos(V, V*)."""
    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a * b).sum() / (a.norm() * b.norm()))

    distance = max(0.0, 1.0 - (cos(u, u_true) * cos(v, v_true)) ** 2) ** 0.5
    return distance, float(u.norm() * v.norm() / (u_true.norm() * v_true.norm()))


def learned_layer_entry(num_in: int = 256, num_out: int = 64) -> dict:
    """A stats-file layer entry: activations with three outlier features (scale 40, like a trained LRM's) over
    4096 rows of 128-row calls, and a weight observed 5 times around a fixed random mean."""
    from loka_trainer.probe.activation import ActivationTracker
    from loka_trainer.probe.weight import WeightTracker

    gen = torch.Generator().manual_seed(0)
    act = ActivationTracker(num_in)
    act.update(outlier_activations(4096, num_in, gen=gen, outliers=(150, 201, 240)))
    act.rows_per_call = 128
    weight = WeightTracker(num_out, num_in, momentum=0.9)
    base = torch.randn(num_out, num_in, generator=gen, dtype=torch.float64) / num_in**0.5
    for _ in range(5):
        weight.update(base + 1e-3 * torch.randn(base.shape, generator=gen, dtype=torch.float64))
    return {"in_features": num_in, "out_features": num_out, "has_bias": False,
            "activation": act.state_dict(), "weight": weight.state_dict()}
