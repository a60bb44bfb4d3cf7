"""CTR metrics as pure functions: log loss, normalized entropy (NE), AUC.

NE = log loss / entropy of the base rate p̄ (the log loss of always predicting the mean label): NE < 1 means the
model beats the base rate; lower is better. AUC is the Mann-Whitney statistic with ties counted as one half.
"""
from __future__ import annotations

import math

import torch

_EPS = 1e-7


@torch.no_grad()
def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """logits, labels: (N,). Mean binary cross-entropy in nats."""
    return torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()).item()


def base_rate_entropy(positive_rate: float) -> float:
    """Entropy (nats) of a Bernoulli(positive_rate); clamped away from 0 and 1."""
    p = min(max(positive_rate, _EPS), 1 - _EPS)
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


@torch.no_grad()
def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """logits, labels: (N,). Log loss divided by the entropy of the empirical base rate."""
    return log_loss(logits, labels) / base_rate_entropy(labels.double().mean().item())


@torch.no_grad()
def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """scores, labels: (N,). Area under the ROC curve; NaN when only one class is present."""
    labels = labels.bool()
    num_pos = int(labels.sum())
    num_neg = labels.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    ranks = _average_ranks(scores.double())
    return ((ranks[labels].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)).item()


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """(N,) -> (N,) 1-based ranks, tied values sharing their mean rank."""
    sorted_x, order = torch.sort(x)
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank_of_group = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(x)
    ranks[order] = mean_rank_of_group[inverse]
    return ranks


def ctr_metrics(logits: torch.Tensor, labels: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """All three metrics at once, keys prefixed (e.g. "eval_")."""
    return {f"{prefix}logloss": log_loss(logits, labels), f"{prefix}ne": normalized_entropy(logits, labels),
            f"{prefix}auc": auc(logits, labels)}
