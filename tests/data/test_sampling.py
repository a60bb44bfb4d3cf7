from __future__ import annotations

import math

import pytest
import torch

from loka_trainer.data.sampling import (
    MAX_DENSE_COUNT, coprime_multiplier, dense_counts, permute_ids, sequence_lengths, zipf_ranks,
)
from loka_trainer.data.schema import counts_from_dense, dense_from_counts


def _uniform(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.1, 1.4])
def test_zipf_ranks_in_range_and_follow_power_law(alpha):
    vocab = 10_000
    ranks = zipf_ranks(_uniform(200_000), torch.tensor(vocab), alpha)
    assert int(ranks.min()) >= 0 and int(ranks.max()) < vocab
    counts = torch.bincount(ranks, minlength=vocab).double()
    # P(rank k) ~ (k+1)^-alpha: the frequency ratio of rank 0 to rank 9 is about 10^alpha.
    ratio = counts[0] / counts[9]
    assert abs(math.log(ratio) / math.log(10.0) - alpha) < 0.25
    top = counts.sort(descending=True).values
    assert top[:10].sum() > 5 * top[-1000:].sum()  # uniform would give 0.01x


def test_zipf_alpha_zero_is_uniform():
    ranks = zipf_ranks(_uniform(100_000), torch.tensor(10), 0.0)
    freq = torch.bincount(ranks, minlength=10).double() / 100_000
    assert torch.allclose(freq, torch.full((10,), 0.1, dtype=torch.float64), atol=0.01)


@pytest.mark.parametrize("vocab", [1, 2, 12, 97, 1000])
def test_permute_ids_is_a_bijection(vocab):
    mult = coprime_multiplier(vocab, 2**30 + 12345)
    assert math.gcd(mult, vocab) == 1
    ids = permute_ids(torch.arange(vocab), torch.tensor(mult), torch.tensor(7 % vocab), torch.tensor(vocab))
    assert sorted(ids.tolist()) == list(range(vocab))


def test_dense_counts_heavy_tailed_with_missing():
    gen = torch.Generator().manual_seed(0)
    mean = torch.tensor([0.5, 3.0], dtype=torch.float64)
    std = torch.tensor([1.0, 2.0], dtype=torch.float64)
    missing = torch.tensor([0.0, 0.3], dtype=torch.float64)
    counts = dense_counts(gen, 50_000, mean, std, missing)
    assert counts.dtype == torch.int64 and int(counts.min()) >= 0 and int(counts.max()) <= MAX_DENSE_COUNT
    assert float(counts[:, 1].double().median()) * 50 < float(counts[:, 1].max())  # heavy tail
    zero_rate = float((counts[:, 1] == 0).double().mean())
    assert 0.3 < zero_rate < 0.45  # 30% missing plus LogNormal draws below 1


def test_dense_transform_round_trips_counts_exactly():
    counts = torch.cat([torch.arange(0, 2000), torch.arange(MAX_DENSE_COUNT - 2000, MAX_DENSE_COUNT + 1)]).view(-1, 1)
    dense = dense_from_counts(counts)
    assert dense.dtype == torch.float32
    assert torch.equal(counts_from_dense(dense), counts)
    assert torch.equal(dense_from_counts(torch.tensor([[-3, 0]])), torch.zeros(1, 2))  # negatives clamp to 0


def test_sequence_lengths_bounds_and_shape():
    lengths = sequence_lengths(torch.Generator().manual_seed(0), 20_000, 40)
    assert int(lengths.min()) == 1 and int(lengths.max()) == 40
    assert float((lengths == 40).double().mean()) > 0.02  # truncated long histories pile up at the cap
    assert 5 <= float(lengths.double().median()) <= 15
