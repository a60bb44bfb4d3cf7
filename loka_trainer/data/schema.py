"""Feature names, vocabulary sizes and the dense transform shared by the synthetic source and the Criteo reader."""
from __future__ import annotations

import torch

from loka_trainer.data.batch import DataSchema
from loka_trainer.data.config import DataConfig

# Distinct values per categorical feature of Criteo Kaggle (Display Advertising Challenge), as used by DLRM.
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
DENSE_NAME = "dense"


def sparse_feature_names(num_sparse: int) -> tuple[str, ...]:
    return tuple(f"cat_{i}" for i in range(num_sparse))


def sequence_feature_names(num_sequences: int) -> tuple[str, ...]:
    return tuple(f"seq_{i}" for i in range(num_sequences))


def sparse_vocab_sizes(num_sparse: int, max_vocab_size: int) -> tuple[int, ...]:
    """Criteo-Kaggle cardinalities (cycled past 26 features) capped at ``max_vocab_size`` so CPU tables stay small."""
    cards = CRITEO_KAGGLE_CARDINALITIES
    return tuple(min(cards[i % len(cards)], max_vocab_size) for i in range(num_sparse))


def data_schema(cfg: DataConfig) -> DataSchema:
    """The features ``build_stream(cfg, ...)`` produces; models size their tables from it."""
    num_seq = cfg.num_sequences
    return DataSchema(
        num_dense=cfg.num_dense,
        sparse_features=sparse_feature_names(cfg.num_sparse),
        sparse_vocab_sizes=sparse_vocab_sizes(cfg.num_sparse, cfg.max_vocab_size),
        sequence_features=sequence_feature_names(num_seq),
        sequence_vocab_sizes=(cfg.sequence_vocab_size,) * num_seq,
        max_sequence_length=cfg.max_sequence_length if num_seq > 0 else 0,
    )


@torch.no_grad()
def dense_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """Criteo dense transform: log(1 + max(x, 0)). counts: (B, F_d) int64 -> (B, F_d) float32.

    NOTE: the synthetic source and the TSV reader both go through this one function, so a written-then-read
    file reproduces the dense tensor bit for bit.
    """
    return torch.log1p(counts.clamp_min(0).double()).float()


@torch.no_grad()
def counts_from_dense(dense: torch.Tensor) -> torch.Tensor:
    """Inverse of ``dense_from_counts`` for non-negative integer counts. dense: (B, F_d) -> (B, F_d) int64."""
    return torch.expm1(dense.double()).round().long()
