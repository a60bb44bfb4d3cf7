"""Small random batches and CPU-sized model configs for the model tests."""
from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.batch import Batch, DataSchema
from loka_trainer.models.dlrm import DLRMConfig, DLRMDCNv2Config
from loka_trainer.models.interformer import InterFormerConfig
from loka_trainer.models.wukong import WukongConfig

MAX_SEQ = 6

# NOTE: helpers reach tests through fixtures (not `from conftest import`), so other test areas'
# conftest modules can never shadow them.


def _make_schema(*, num_sparse: int = 26, vocab: int = 100, num_dense: int = 13, num_seq: int = 2) -> DataSchema:
    return DataSchema(
        num_dense=num_dense,
        sparse_features=tuple(f"c{i}" for i in range(num_sparse)),
        sparse_vocab_sizes=(vocab,) * num_sparse,
        sequence_features=tuple(f"q{i}" for i in range(num_seq)),
        sequence_vocab_sizes=(vocab,) * num_seq,
        max_sequence_length=MAX_SEQ if num_seq else 0,
    )


def _kjt(keys, lengths: torch.Tensor, vocab: int, gen: torch.Generator) -> KeyedJaggedTensor:
    """lengths: (len(keys) * B,) key-major, as KJT stores them."""
    values = torch.randint(0, vocab, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=values, lengths=lengths)


def _make_batch(schema: DataSchema, batch_size: int, *, seed: int = 0, multi_hot: int = 2) -> Batch:
    """Random batch: 1..multi_hot ids per sparse feature, sequences of length 0..max+2 (truncation)."""
    gen = torch.Generator().manual_seed(seed)
    num_sparse = len(schema.sparse_features)
    sparse_lengths = torch.randint(1, multi_hot + 1, (num_sparse * batch_size,), generator=gen)
    sequences = None
    if schema.sequence_features:
        num_rows = len(schema.sequence_features) * batch_size
        seq_lengths = torch.randint(0, schema.max_sequence_length + 3, (num_rows,), generator=gen)
        sequences = _kjt(schema.sequence_features, seq_lengths, min(schema.sequence_vocab_sizes), gen)
    return Batch(
        dense=torch.randn(batch_size, schema.num_dense, generator=gen),
        sparse=_kjt(schema.sparse_features, sparse_lengths, min(schema.sparse_vocab_sizes), gen),
        labels=torch.randint(0, 2, (batch_size,), generator=gen).float(),
        sequences=sequences,
    )


def _small_config(name: str, **overrides):
    """CPU-sized config of each model (tests only; the yaml files hold the user-facing small sizes)."""
    configs = {
        "dlrm": lambda: DLRMConfig(embedding_dim=8, dense_arch_widths=[16, 8], over_arch_widths=[16]),
        "dlrm_dcnv2": lambda: DLRMDCNv2Config(
            embedding_dim=8, dense_arch_widths=[16, 8], over_arch_widths=[16], cross_layers=2, cross_rank=8
        ),
        "wukong": lambda: WukongConfig(
            embedding_dim=8, num_dense_embeddings=2, dense_arch_widths=[16], num_layers=2,
            num_fm_embeddings=4, num_lc_embeddings=4, fm_rank=4, fmb_widths=[16], over_arch_widths=[16],
        ),
        "interformer": lambda: InterFormerConfig(
            embedding_dim=8, num_dense_embeddings=2, dense_arch_widths=[16], num_layers=2, num_heads=2,
            interaction_widths=[16], cross_layers=1, cross_rank=4, num_summary_embeddings=2,
            num_cls_tokens=2, num_pma_seeds=2, num_recent_tokens=2, pffn_widths=[16], over_arch_widths=[16],
        ),
    }
    cfg = configs[name]()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@pytest.fixture(scope="session")
def make_schema():
    return _make_schema


@pytest.fixture(scope="session")
def make_batch():
    return _make_batch


@pytest.fixture(scope="session")
def small_config():
    return _small_config


@pytest.fixture(scope="session")
def schema() -> DataSchema:
    return _make_schema()


@pytest.fixture(scope="session")
def batch(schema) -> Batch:
    return _make_batch(schema, 16)

