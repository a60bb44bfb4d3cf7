from __future__ import annotations

import torch

from loka_trainer.probe.activation import ActivationTracker, dense_covariance
from loka_trainer.probe.sampling import sample_activations, sample_weight, weight_factors

from .helpers import DT, gaussian_rows, random_spd, rel_err


def test_activation_samples_reproduce_tracked_moments():
    gen = torch.Generator().manual_seed(0)
    tracker = ActivationTracker(9)
    tracker.update(gaussian_rows(5000, torch.randn(9, generator=gen, dtype=DT) * 4, random_spd(9, gen=gen), gen=gen))
    samples = sample_activations(tracker.moments, 40_000, generator=gen)
    assert samples.shape == (40_000, 9)
    assert rel_err(torch.cov(samples.T), dense_covariance(tracker.moments)) < 0.03
    stderr = dense_covariance(tracker.moments).diagonal().sqrt() / 200  # sqrt(40k) = 200
    assert torch.all((samples.mean(0) - tracker.moments.mean).abs() < 5 * stderr)


def test_block_diagonal_samples_have_no_cross_block_correlation():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4000, 1, generator=gen, dtype=DT).repeat(1, 6)  # every feature perfectly correlated
    x = x + 0.1 * torch.randn(4000, 6, generator=gen, dtype=DT)
    tracker = ActivationTracker(6, max_full_covariance=4, covariance_block=3)
    tracker.update(x)
    corr = torch.corrcoef(sample_activations(tracker.moments, 20_000, generator=gen).T)
    assert corr[0, 1] > 0.9  # within a block: kept
    assert corr[0, 4].abs() < 0.05  # across blocks: dropped by the bounded representation


def test_weight_samples_reproduce_matrix_normal_moments():
    gen = torch.Generator().manual_seed(2)
    mean = torch.randn(5, 4, generator=gen, dtype=DT)
    u, v = random_spd(5, gen=gen), random_spd(4, gen=gen)
    lu, lv = weight_factors(u, v)
    draws = torch.stack([sample_weight(mean, lu, lv, generator=gen) for _ in range(20_000)])  # (S, O, I)
    centered = draws - mean
    # E[Wc Wc^T] = U tr(V),  E[Wc^T Wc] = V tr(U)
    assert rel_err(torch.einsum("soi,spi->op", centered, centered) / len(draws), u * v.trace()) < 0.03
    assert rel_err(torch.einsum("soi,soj->ij", centered, centered) / len(draws), v * u.trace()) < 0.03
    assert rel_err(draws.mean(0), mean) < 0.05


def test_diagonal_weight_factors_sample_elementwise_variance():
    gen = torch.Generator().manual_seed(3)
    u, v = torch.tensor([1.0, 4.0], dtype=DT), torch.tensor([0.25, 1.0, 9.0], dtype=DT)
    lu, lv = weight_factors(u, v)
    draws = torch.stack([sample_weight(torch.zeros(2, 3, dtype=DT), lu, lv, generator=gen) for _ in range(20_000)])
    assert rel_err(draws.var(0), torch.outer(u, v)) < 0.05
