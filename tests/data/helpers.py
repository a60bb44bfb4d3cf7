"""Shared helpers for the data tests."""
from __future__ import annotations

import torch

from loka_trainer.data.batch import Batch


def rank_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney AUC of ``scores`` (N,) against binary ``labels`` (N,); ties are negligible for float scores."""
    ranks = torch.empty(scores.numel(), dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    num_pos = labels.sum().double()
    num_neg = labels.numel() - num_pos
    return float((ranks[labels == 1].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def row_keys(batch: Batch) -> set[tuple]:
    """One hashable tuple per row: (dense values..., sparse ids...) for single-id features."""
    num_keys = len(batch.sparse.keys())
    ids = batch.sparse.values().view(num_keys, len(batch)).t()
    return {tuple(d) + tuple(i) for d, i in zip(batch.dense.tolist(), ids.tolist())}


def assert_batches_equal(a: Batch, b: Batch) -> None:
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())
    assert (a.sequences is None) == (b.sequences is None)
    if a.sequences is not None:
        assert torch.equal(a.sequences.values(), b.sequences.values())
        assert torch.equal(a.sequences.lengths(), b.sequences.lengths())
