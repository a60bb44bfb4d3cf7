"""Embedding lookups (TorchRec) shared by every model.

Notation: B batch, F_s pooled sparse features, F_q sequence features, T max sequence length,
D embedding dim, L total number of ids of one sequence feature in the batch.

NOTE: TorchRec's ``DistributedModelParallel`` swaps the EmbeddingBagCollection /
EmbeddingCollection for sharded versions, so they are only ever called as ``ebc(kjt)`` /
``ec(kjt)``; everything done with their outputs happens outside them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.batch import DataSchema


def build_ebc(schema: DataSchema, embedding_dim: int) -> EmbeddingBagCollection:
    """One pooled (sum) table per sparse feature, on CPU (sharding moves it later)."""
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], num_embeddings=v, embedding_dim=embedding_dim)
        for f, v in zip(schema.sparse_features, schema.sparse_vocab_sizes)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


def build_ec(schema: DataSchema, embedding_dim: int) -> EmbeddingCollection:
    """One unpooled table per sequence feature, on CPU."""
    if not schema.sequence_features:
        raise ValueError("data schema has no sequence_features; this model needs behaviour sequences")
    tables = [
        EmbeddingConfig(name=f"t_{f}", feature_names=[f], num_embeddings=v, embedding_dim=embedding_dim)
        for f, v in zip(schema.sequence_features, schema.sequence_vocab_sizes)
    ]
    return EmbeddingCollection(tables=tables, device=torch.device("cpu"))


def left_pad_jagged(
    values: torch.Tensor, lengths: torch.Tensor, max_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged rows (oldest -> newest) to a dense tensor with the newest item at the last position.

    values: (L, D), lengths: (B,) -> padded (B, T, D) with zeros where invalid, mask (B, T) bool.
    Rows longer than ``max_length`` keep their newest ``max_length`` items. Right-aligning makes
    position ``T-1-j`` "the j-th most recent item" for every row and every feature.
    Differentiable in ``values`` (a gather).
    """
    offsets = torch.cumsum(lengths, 0) - lengths  # (B,) start of each row
    pos = torch.arange(max_length, device=values.device)  # (T,)
    src = offsets[:, None] + lengths[:, None] - max_length + pos[None, :]  # (B, T)
    mask = pos[None, :] >= (max_length - lengths[:, None])  # (B, T)
    gathered = values[src.clamp(min=0, max=max(values.shape[0] - 1, 0))] if values.shape[0] else None
    if gathered is None:  # empty batch of sequences: nothing to gather
        return values.new_zeros(lengths.shape[0], max_length, values.shape[-1]), mask
    return gathered * mask[..., None].to(values.dtype), mask


class SparseArch(nn.Module):
    """All embedding lookups of a model.

    forward(sparse KJT[, sequences KJT]) -> pooled (B, F_s, D) and, when the model has
    sequences, a dict feature -> (values (L, D), lengths (B,)) in schema order.
    """

    def __init__(self, ebc: EmbeddingBagCollection, ec: Optional[EmbeddingCollection] = None) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec
        self.feature_names = [f for c in ebc.embedding_bag_configs() for f in c.feature_names]

    def pooled(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """(B, F_s, D): one pooled embedding per sparse feature, in the table (= schema) order."""
        # By name, not by position: a sharded EBC need not return its keys in config order.
        by_name = self.ebc(sparse).to_dict()
        return torch.stack([by_name[f] for f in self.feature_names], dim=1)

    def sequences(self, sequences: KeyedJaggedTensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """feature -> (values (L, D), lengths (B,)) of the unpooled sequence embeddings."""
        assert self.ec is not None, "model built without sequence tables"
        return {k: (jt.values(), jt.lengths()) for k, jt in self.ec(sequences).items()}

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.pooled(sparse)
