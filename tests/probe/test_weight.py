from __future__ import annotations

import pytest
import torch

from loka_trainer.probe.weight import WeightTracker, matrix_normal_update

from .helpers import DT, random_spd, rel_err


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
    for _ in range(800):  # 0.98^800 ~ 1e-7: the isotropic cold start is washed out
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
                                torch.eye(7, dtype=DT), momentum=0.9)
    assert torch.allclose(u, u.T) and torch.allclose(v, v.T)
    assert torch.linalg.eigvalsh(u).min() > 0 and torch.linalg.eigvalsh(v).min() > 0


def test_rank_deficient_update_stays_positive_definite():
    # A single rank-1 centered weight makes U' and V' singular; symmetrization + eps I must keep them SPD.
    wc = torch.outer(torch.arange(1.0, 5.0, dtype=DT), torch.ones(3, dtype=DT))
    u, v = torch.eye(4, dtype=DT), torch.eye(3, dtype=DT)
    for _ in range(200):
        u, v = matrix_normal_update(wc, u, v, momentum=0.5)
    assert torch.linalg.eigvalsh(u).min() > 0 and torch.linalg.eigvalsh(v).min() > 0
    torch.linalg.cholesky(u); torch.linalg.cholesky(v)


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
    with pytest.raises(ValueError, match="momentum"):
        WeightTracker(3, 3, momentum=1.0)
    tracker = WeightTracker(3, 4)
    with pytest.raises(ValueError, match="shape"):
        tracker.update(torch.randn(4, 3))
