from __future__ import annotations

import pytest
import torch

from loka_trainer.probe.sampling import sample_weight, weight_factors
from loka_trainer.probe.weight import WeightTracker, ema_coefficients, matrix_normal_update

from .helpers import DT, kron_distance, random_spd, rel_err


def _draw(mean, lu, lv, gen):
    return mean + lu @ torch.randn(mean.shape, generator=gen, dtype=DT) @ lv.T


def _normalized(f: torch.Tensor) -> torch.Tensor:
    return f / f.diagonal().sum()


def test_recovers_row_and_column_covariance_up_to_scale():
    gen = torch.Generator().manual_seed(0)
    num_out, num_in = 8, 6
    u_true, v_true = random_spd(num_out, gen=gen), random_spd(num_in, gen=gen)
    mean = torch.randn(num_out, num_in, generator=gen, dtype=DT)
    lu, lv = torch.linalg.cholesky(u_true), torch.linalg.cholesky(v_true)
    tracker = WeightTracker(num_out, num_in, momentum=0.98)
    for _ in range(800):
        tracker.update(_draw(mean, lu, lv, gen))
    # EMA with m=0.98 averages ~100 draws; worst over 8 seeds: U 0.11, V 0.09, V(x)U 0.15, mean 0.15.
    # A wrong update (e.g. no whitening, transposed factors) gives errors near 0.5 or more.
    assert rel_err(_normalized(tracker.u), _normalized(u_true)) < 0.15
    assert rel_err(_normalized(tracker.v), _normalized(v_true)) < 0.15
    assert rel_err(torch.kron(tracker.v, tracker.u), torch.kron(v_true, u_true)) < 0.2  # the identifiable part
    assert float(tracker.u.diagonal().sum()) == pytest.approx(num_out)  # trace renormalization
    # EMA mean noise: std = sqrt((1-m)/(1+m) Var(W)) ~ 0.11 of |M| here; ~3 sigma.
    assert rel_err(tracker.mean, mean) < 0.35


def test_update_never_forms_an_explicit_inverse(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("explicit inverse used")

    for name in ("inv", "pinv", "inv_ex"):
        monkeypatch.setattr(torch.linalg, name, forbidden)
    monkeypatch.setattr(torch, "inverse", forbidden)
    gen = torch.Generator().manual_seed(1)
    u, v = matrix_normal_update(torch.randn(5, 7, generator=gen, dtype=DT), torch.eye(5, dtype=DT),
                                torch.eye(7, dtype=DT), shape_gain=0.1)
    assert torch.allclose(u, u.T) and torch.allclose(v, v.T)
    assert torch.linalg.eigvalsh(u).min() > 0 and torch.linalg.eigvalsh(v).min() > 0
    assert float(u.trace()) == pytest.approx(5) and float(v.trace()) == pytest.approx(7)  # shapes keep their trace


def test_rank_deficient_deviations_still_give_usable_factors():
    # Deviations along one rank-1 direction make every moment singular; the factors must stay finite and
    # factorizable (Cholesky of F + eps I), and samples finite.
    gen = torch.Generator().manual_seed(3)
    direction = torch.outer(torch.arange(1.0, 5.0, dtype=DT), torch.ones(3, dtype=DT))
    tracker = WeightTracker(4, 3, momentum=0.5)
    for _ in range(200):
        tracker.update(float(torch.randn((), generator=gen, dtype=DT)) * direction)
    lu, lv = weight_factors(tracker.u, tracker.v)
    assert torch.isfinite(lu).all() and torch.isfinite(lv).all()
    assert torch.isfinite(sample_weight(tracker.mean, lu, lv, generator=gen)).all()


def _planted_stream(num_out: int, num_in: int, gen: torch.Generator):
    """M (std 1) and factors A (O, O), B (I, I) of a deviation A Z B^T 100x smaller in variance than M."""
    mean = torch.randn(num_out, num_in, generator=gen, dtype=DT)
    a = 0.1 * torch.randn(num_out, num_out, generator=gen, dtype=DT) / num_out**0.5
    b = torch.randn(num_in, num_in, generator=gen, dtype=DT) / num_in**0.5
    return mean, a, b


@pytest.mark.parametrize("stats_dtype", ["float64", "float32"])
def test_planted_matrix_normal_stream_is_recovered(stats_dtype):
    """W_t = M + A Z_t B^T, 300 draws, momentum 0.99: U (x) V must match (A A^T) (x) (B B^T) in shape and size.
    A batch maximum-likelihood fit of such draws gets 0.06; a tracker whose V starts at var(W_1) I (the
    weight's own variance, not its deviation's) gets 0.41 here, at 0.68x the size."""
    gen = torch.Generator().manual_seed(0)
    num_out, num_in = 48, 80
    mean, a, b = _planted_stream(num_out, num_in, gen)
    tracker = WeightTracker(num_out, num_in, momentum=0.99, stats_dtype=stats_dtype)
    for _ in range(300):
        tracker.update(mean + a @ torch.randn(num_out, num_in, generator=gen, dtype=DT) @ b.T)
    distance, size = kron_distance(tracker.u, tracker.v, a @ a.T, b @ b.T)
    assert distance < 0.15  # 0.08 here: the EMA averages ~200 draws
    assert 1 / 1.5 < size < 1.5
    # The offline MERE samples M + L_U Z L_V^T: their per-element variance is the deviation's.
    lu, lv = weight_factors(tracker.u, tracker.v)
    samples = torch.stack([sample_weight(tracker.mean, lu, lv, generator=gen) for _ in range(100)])
    true_variance = float((a @ a.T).trace() * (b @ b.T).trace()) / (num_out * num_in)
    assert float((samples - tracker.mean).square().mean()) == pytest.approx(true_variance, rel=0.1)
    assert rel_err(tracker.mean, mean) < 0.02


@pytest.mark.parametrize("stats_dtype", ["float64", "float32"])
def test_a_drifting_mean_does_not_inflate_the_deviation(stats_dtype):
    """W_t = M + t eps D + sigma Z_t: the deviation is measured around the running mean, so the variance stays
    near sigma^2 (plus the drift's variance inside the EMA window, 90 eps^2 at m = 0.9) from the first
    observations on, while around W_1 it would reach ~27 sigma^2 by t = 300."""
    gen = torch.Generator().manual_seed(4)
    num_out, num_in, sigma = 24, 40, 1e-2
    eps = 0.03 * sigma
    mean = torch.randn(num_out, num_in, generator=gen, dtype=DT)
    drift = torch.randn(num_out, num_in, generator=gen, dtype=DT)
    tracker = WeightTracker(num_out, num_in, momentum=0.9, stats_dtype=stats_dtype)
    for t in range(1, 301):
        tracker.update(mean + t * eps * drift + sigma * torch.randn(num_out, num_in, generator=gen, dtype=DT))
        if t in (3, 5, 20, 100, 300):
            per_element = float(tracker.v.trace() * tracker.u.trace()) / (num_out * num_in)
            assert 0.8 * sigma**2 < per_element < 1.3 * sigma**2, (t, per_element / sigma**2)


def test_a_frozen_weight_has_zero_deviation():
    w = torch.randn(6, 5, dtype=DT)
    tracker = WeightTracker(6, 5, momentum=0.99)
    for _ in range(4):
        tracker.update(w)
    assert torch.equal(tracker.mean, w) and float(tracker.v.abs().sum()) == 0.0
    assert torch.isfinite(tracker.u).all() and float(tracker.u.trace()) == pytest.approx(6)
    lu, lv = weight_factors(tracker.u, tracker.v)
    assert torch.allclose(sample_weight(tracker.mean, lu, lv), w)


def test_ema_coefficients_are_the_weighted_mean_and_unbiased_variance():
    # With momentum m the t-th estimate is the m^(t-s)-weighted mean / reliability-weighted variance of all
    # observations; check the recursions against the direct formulas on a scalar stream.
    gen = torch.Generator().manual_seed(5)
    m, xs = 0.9, torch.randn(30, generator=gen, dtype=DT)
    mean, var = 0.0, 0.0
    for t, x in enumerate(xs.tolist(), start=1):
        c = ema_coefficients(t, m)
        dev = x - mean
        var = c.keep * var + c.gain * dev**2
        mean = mean + c.mean_gain * dev
        w = m ** torch.arange(t - 1, -1, -1, dtype=DT)
        direct_mean = float((w * xs[:t]).sum() / w.sum())
        assert mean == pytest.approx(direct_mean)
        if t > 1:
            direct_var = float((w * (xs[:t] - direct_mean) ** 2).sum() / (w.sum() - (w**2).sum() / w.sum()))
            assert var == pytest.approx(direct_var)


def test_wide_dims_use_diagonal_factors_and_keep_variances():
    gen = torch.Generator().manual_seed(2)
    row_std = torch.linspace(0.5, 3.0, 6, dtype=DT)
    col_std = torch.linspace(1.0, 2.0, 10, dtype=DT)
    tracker = WeightTracker(6, 10, momentum=0.98, max_full_covariance=8)  # V diagonal, U full
    assert tracker.representation == "U:full,V:diagonal"
    for _ in range(800):
        tracker.update(row_std[:, None] * torch.randn(6, 10, generator=gen, dtype=DT) * col_std)
    assert tracker.v.ndim == 1 and tracker.u.ndim == 2
    variances = torch.outer(tracker.u.diagonal(), tracker.v)  # Var(W_ij) = U_ii V_jj
    assert rel_err(variances, torch.outer(row_std**2, col_std**2)) < 0.15


def test_shape_mismatch_and_bad_momentum_are_rejected():
    for momentum in (0.0, 1.0):
        with pytest.raises(ValueError, match="momentum"):
            WeightTracker(3, 3, momentum=momentum)
    tracker = WeightTracker(3, 4)
    with pytest.raises(ValueError, match="shape"):
        tracker.update(torch.randn(4, 3))


@pytest.mark.parametrize("saved_full, now_full", [(1, 100), (100, 1)])
def test_a_state_of_another_factor_representation_is_refused_and_changes_nothing(saved_full, now_full):
    gen = torch.Generator().manual_seed(3)
    saved = WeightTracker(6, 8, max_full_covariance=saved_full)
    for _ in range(3):
        saved.update(torch.randn(6, 8, generator=gen))
    tracker = WeightTracker(6, 8, max_full_covariance=now_full)
    with pytest.raises(ValueError, match="max_full_weight_factor") as info:
        tracker.load_state_dict(saved.state_dict())
    assert "\n" not in str(info.value)
    assert tracker.count == 0 and tracker.mean is None  # the tracker is as it was
