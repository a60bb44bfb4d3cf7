"""Vectorised samplers for the synthetic source: Zipf ids, heavy-tailed dense counts, sequence lengths.

All take an explicit ``torch.Generator`` (one per batch) and never loop over rows.
"""
from __future__ import annotations

import math

import torch

# Dense counts are clipped so that ``counts_from_dense(dense_from_counts(x))`` is exact in float32
# (log1p(1e5) ~ 11.5: half an ulp there is ~5e-7, i.e. < 0.05 counts).
MAX_DENSE_COUNT = 100_000


@torch.no_grad()
def zipf_ranks(uniform: torch.Tensor, vocab: torch.Tensor, alpha: float) -> torch.Tensor:
    """Popularity ranks with P(rank = k) ~ (k + 1)^-alpha over [0, vocab) (continuous inverse-CDF approximation).

    uniform: (...) float64 in (0, 1); vocab: int64 broadcastable to it -> (...) int64 in [0, vocab).
    """
    v1 = vocab.double() + 1.0
    if abs(alpha - 1.0) < 1e-6:
        x = torch.pow(v1, uniform)
    else:
        e = 1.0 - alpha
        x = torch.pow(1.0 - uniform * (1.0 - torch.pow(v1, e)), 1.0 / e)
    ranks = x.floor().long() - 1
    return torch.minimum(ranks.clamp_min(0), vocab - 1)


@torch.no_grad()
def permute_ids(ranks: torch.Tensor, multiplier: torch.Tensor, offset: torch.Tensor,
                vocab: torch.Tensor) -> torch.Tensor:
    """Bijection rank -> id, ``(multiplier * rank + offset) mod vocab`` with gcd(multiplier, vocab) = 1.

    Why: hot ids land anywhere in the table (like hashed Criteo ids), not all in the first rows of shard 0.
    ranks: (...) int64; multiplier/offset/vocab: int64 broadcastable -> (...) int64 in [0, vocab).
    """
    return (ranks * multiplier + offset) % vocab


def coprime_multiplier(vocab: int, start: int) -> int:
    """The first integer >= ``start`` (expected in [2**30, 2**31)) coprime with ``vocab``."""
    value = start
    while math.gcd(value, vocab) != 1:
        value += 1
    return value


@torch.no_grad()
def dense_counts(gen: torch.Generator, batch_size: int, log_mean: torch.Tensor, log_std: torch.Tensor,
                 missing_rate: torch.Tensor) -> torch.Tensor:
    """Criteo-like integer counts: floor(LogNormal(log_mean, log_std)), 0 where missing, clipped.

    log_mean/log_std/missing_rate: (F_d,) float64 -> (B, F_d) int64 in [0, MAX_DENSE_COUNT].
    """
    num_dense = log_mean.shape[0]
    normal = torch.randn(batch_size, num_dense, generator=gen, dtype=torch.float64)
    counts = torch.exp(log_mean + log_std * normal).floor().clamp(max=MAX_DENSE_COUNT).long()
    missing = torch.rand(batch_size, num_dense, generator=gen, dtype=torch.float64) < missing_rate
    return counts.masked_fill(missing, 0)


@torch.no_grad()
def sequence_lengths(gen: torch.Generator, num: int, max_length: int) -> torch.Tensor:
    """History lengths: log-normal around max_length / 4, clipped to [1, max_length].

    The clip leaves a visible mass at ``max_length`` (long histories truncated), as in production logs.
    -> (num,) int64.
    """
    median = max(max_length / 4.0, 1.0)
    normal = torch.randn(num, generator=gen, dtype=torch.float64)
    lengths = torch.exp(math.log(median) + 1.0 * normal).round().long()
    return lengths.clamp(1, max_length)
