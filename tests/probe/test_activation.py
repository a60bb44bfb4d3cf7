from __future__ import annotations

import pytest
import torch

from loka_trainer.probe.activation import (ActivationTracker, batch_moments, dense_covariance, empty_moments,
                                           merge_all, merge_moments)

from .helpers import DT, gaussian_rows, random_spd, rel_err


def test_tracker_recovers_known_mean_and_covariance():
    gen = torch.Generator().manual_seed(0)
    num_features, num_rows = 12, 40_000
    mean = 3.0 * torch.randn(num_features, generator=gen, dtype=DT)
    cov = random_spd(num_features, gen=gen)
    tracker = ActivationTracker(num_features)
    for chunk in gaussian_rows(num_rows, mean, cov, gen=gen).split(997):  # uneven batches
        tracker.update(chunk.float())
    # Tolerances: ~4 standard errors of the sample mean / covariance at n = 40k.
    stderr = (cov.diagonal() / num_rows).sqrt()
    assert torch.all((tracker.moments.mean - mean).abs() < 4 * stderr)
    assert rel_err(dense_covariance(tracker.moments), cov) < 0.03
    assert int(tracker.moments.count) == num_rows


@pytest.mark.parametrize("block", [10, 4, 3])
def test_streaming_merge_equals_one_shot(block):
    gen = torch.Generator().manual_seed(1)
    x = gaussian_rows(3000, torch.randn(10, generator=gen, dtype=DT), random_spd(10, gen=gen), gen=gen)
    tracker = ActivationTracker(10, max_full_covariance=block if block == 10 else 1, covariance_block=block)
    for chunk in x.split(128):
        tracker.update(chunk)
    one_shot = torch.cov(x.T)
    mask = torch.block_diag(*[torch.ones(block, block, dtype=DT)] * 4)[:10, :10]  # keep only in-block entries
    torch.testing.assert_close(dense_covariance(tracker.moments), one_shot * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tracker.moments.mean, x.mean(0), rtol=1e-6, atol=1e-6)
    assert tracker.representation == ("full" if block == 10 else f"block_diagonal:{block}")


def test_merging_two_ranks_equals_one_process():
    gen = torch.Generator().manual_seed(2)
    x = gaussian_rows(2500, torch.randn(6, generator=gen, dtype=DT) * 5, random_spd(6, gen=gen), gen=gen)
    rank0, rank1, single = ActivationTracker(6), ActivationTracker(6), ActivationTracker(6)
    rank0.update(x[:700])  # unequal shares, as with uneven last batches
    rank1.update(x[700:1500]); rank1.update(x[1500:])
    single.update(x)
    for merged in (merge_moments(rank0.moments, rank1.moments), merge_moments(rank1.moments, rank0.moments)):
        torch.testing.assert_close(merged.scatter, single.moments.scatter, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(merged.mean, single.moments.mean)
        assert float(merged.count) == 2500
        torch.testing.assert_close(merged.max_abs, x.abs().amax(0))


def test_merge_is_associative_and_empty_is_identity():
    gen = torch.Generator().manual_seed(3)
    parts = [batch_moments(torch.randn(n, 5, generator=gen) + n, block=5) for n in (3, 50, 17)]
    left = merge_all(parts)
    right = merge_moments(parts[0], merge_moments(parts[1], parts[2]))
    torch.testing.assert_close(left.scatter, right.scatter, rtol=1e-5, atol=1e-4)
    empty = empty_moments(5, 5, dtype=torch.float32)
    both_empty = merge_moments(empty, empty)
    assert torch.isfinite(both_empty.mean).all() and float(both_empty.count) == 0
    torch.testing.assert_close(merge_moments(empty, parts[1]).scatter, parts[1].scatter)


def test_leading_dims_are_flattened_and_shape_checked():
    tracker = ActivationTracker(4)
    tracker.update(torch.randn(3, 5, 4))
    assert int(tracker.moments.count) == 15 and tracker.rows_per_call == 15
    with pytest.raises(ValueError, match="features"):
        tracker.update(torch.randn(2, 3))


def test_state_dict_round_trip():
    src = ActivationTracker(8, max_full_covariance=4, covariance_block=3)
    src.update(torch.randn(64, 8))
    dst = ActivationTracker(8, max_full_covariance=4, covariance_block=3)
    dst.load_state_dict(src.state_dict())
    torch.testing.assert_close(dst.moments.scatter, src.moments.scatter)
    with pytest.raises(ValueError, match="scatter"):
        ActivationTracker(8).load_state_dict(src.state_dict())




def test_exact_fp32_matmuls_inside_the_block_and_flags_restored_after():
    from loka_trainer.matmul_precision import exact_fp32_matmuls
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    with exact_fp32_matmuls():
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "highest"
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before


def test_sampled_rows_estimate_the_moments_and_max_abs_covers_every_row():
    gen = torch.Generator().manual_seed(3)
    mean, cov = torch.randn(6, generator=gen, dtype=DT), random_spd(6, gen=gen)
    sampled, full = ActivationTracker(6, sample_rows=512), ActivationTracker(6)
    for _ in range(60):
        x = gaussian_rows(4096, mean, cov, gen=gen).float()
        x[17, 2] = 1e4  # one outlier row: a 512-row sample misses it most of the time, max|x| must not
        sampled.update(x)
        full.update(x)
    assert int(sampled.moments.count) == 60 * 512 and sampled.rows_per_call == 4096  # the GEMM's M is all rows
    assert float(sampled.moments.max_abs[2]) == 1e4
    clean = full.moments.scatter[0].clone()
    # 30k sampled rows: ~4 standard errors of the mean; the covariance (outlier included by chance) within a few %
    stderr = (cov.diagonal() / (60 * 512)).sqrt()
    keep = torch.arange(6) != 2
    assert torch.all((sampled.moments.mean - full.moments.mean).abs()[keep] < 4 * stderr[keep])
    sampled_cov = dense_covariance(sampled.moments)[keep][:, keep]
    assert rel_err(sampled_cov, (clean / (full.moments.count - 1))[keep][:, keep]) < 0.05


def test_row_sampling_leaves_the_training_random_stream_alone_and_repeats_per_seed():
    x = torch.randn(1000, 4)
    state = torch.get_rng_state()
    a, b, c = (ActivationTracker(4, sample_rows=10, seed=s) for s in (1, 1, 2))
    for tracker in (a, b, c):
        tracker.update(x)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.moments.mean, b.moments.mean) and not torch.equal(a.moments.mean, c.moments.mean)
    with pytest.raises(ValueError, match="sample_rows"):
        ActivationTracker(4, sample_rows=-1)


@pytest.mark.parametrize("block", [7, 3])
def test_summary_scalars_are_the_inputs_mean_std_and_max_abs(block):
    from loka_trainer.probe.activation import summary_scalars
    x = torch.randn(300, 7) * torch.arange(1.0, 8.0) + 2.0
    x[5, 3] = -50.0
    mean, std, max_abs = summary_scalars(batch_moments(x, block=block)).tolist()
    assert mean == pytest.approx(float(x.mean()), rel=1e-5)
    assert std == pytest.approx(float(x.std(unbiased=False)), rel=1e-4)
    assert max_abs == 50.0


def test_a_tracker_restored_from_its_state_samples_the_rows_the_uninterrupted_one_does():
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(64, 5, generator=gen) for _ in range(4)]
    uninterrupted, first = (ActivationTracker(5, sample_rows=8, seed=7) for _ in range(2))
    for x in batches:
        uninterrupted.update(x)
    for x in batches[:2]:
        first.update(x)
    resumed = ActivationTracker(5, sample_rows=8, seed=7)
    resumed.load_state_dict(first.state_dict())  # a checkpoint between the second and third observation
    for x in batches[2:]:
        resumed.update(x)
    for got, expected in zip(resumed.moments.tensors(), uninterrupted.moments.tensors()):
        assert torch.equal(got, expected)


def test_a_state_without_the_call_number_loads_and_numbers_the_next_call_from_zero():
    gen = torch.Generator().manual_seed(5)
    seen, nxt = torch.randn(64, 5, generator=gen), torch.randn(64, 5, generator=gen)
    first = ActivationTracker(5, sample_rows=8, seed=7)
    first.update(seen)
    state = {k: v for k, v in first.state_dict().items() if k != "calls"}  # a checkpoint that lacks the number
    resumed = ActivationTracker(5, sample_rows=8, seed=7)
    resumed.load_state_dict(state)
    assert resumed.calls == 0 and torch.equal(resumed.moments.count, first.moments.count)
    fresh = ActivationTracker(5, sample_rows=8, seed=7)
    assert torch.equal(resumed.update(nxt).mean, fresh.update(nxt).mean)  # the row sample of call 0


@pytest.mark.parametrize("sample_rows", [0, 8])
def test_an_observed_call_with_no_rows_leaves_the_statistics_as_they_were(sample_rows):
    tracker = ActivationTracker(5, sample_rows=sample_rows, covariance_block=2, max_full_covariance=2)
    tracker.update(torch.randn(16, 5))
    before = [t.clone() for t in tracker.moments.tensors()]
    tracker.update(torch.randn(0, 3, 5))  # e.g. a rank whose batch holds no rows
    for got, expected in zip(tracker.moments.tensors(), before):
        assert torch.equal(got, expected)
    assert tracker.rows_per_call == 16  # the GEMM's M that the report uses
