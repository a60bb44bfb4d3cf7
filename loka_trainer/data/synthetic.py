"""Synthetic Criteo-like source with a planted teacher: any batch computable from (seed, split, rank, index).

Notation: B batch, F_s sparse features, m ids per bag (multi_hot), F_d dense, F_q sequence features.

Stream layout: global chunk ``g = index * world_size + rank`` of split ``s`` is generated from a generator seeded
with ``derive_seed(seed, s, g)``. So ranks and splits never share a chunk, batch ``index`` needs no earlier
batch (O(1) resume), and the union over ranks is the same global sequence for any world size. With
``data.outliers`` on, the outliers come from a second generator seeded with ``derive_seed(seed, s, g, "outliers")``:
the rows are the same as with it off, plus the outliers (labels then follow the teacher's view of them).
"""
from __future__ import annotations

import dataclasses

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.batch import Batch, DataSchema
from loka_trainer.data.config import DataConfig
from loka_trainer.data.hashing import derive_seed, generator
from loka_trainer.data.outliers import channel_scale, hot_channels, inject_outliers, teacher_dense
from loka_trainer.data.sampling import coprime_multiplier, dense_counts, permute_ids, sequence_lengths, zipf_ranks
from loka_trainer.data.schema import data_schema, dense_from_counts
from loka_trainer.data.teacher import TeacherParams, calibrate_teacher, draw_teacher_params, teacher_logits

CALIBRATION_ROWS = 8192


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
    """Fixed per-feature sampling parameters drawn from the seed.

    vocab/id_multiplier/id_offset: (F_s,) int64; dense_*: (F_d,) float64; seq_multiplier/seq_offset: (F_q,) int64.
    """

    schema: DataSchema
    zipf_alpha: float
    multi_hot: int
    vocab: torch.Tensor
    id_multiplier: torch.Tensor
    id_offset: torch.Tensor
    dense_log_mean: torch.Tensor
    dense_log_std: torch.Tensor
    dense_missing: torch.Tensor
    seq_multiplier: torch.Tensor
    seq_offset: torch.Tensor


def _affine_params(gen: torch.Generator, vocabs: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(2**30, 2**31 - 2**20, (len(vocabs),), generator=gen).tolist()
    offsets = torch.randint(0, 2**31, (len(vocabs),), generator=gen)
    mult = torch.tensor([coprime_multiplier(v, s) for v, s in zip(vocabs, starts)], dtype=torch.int64)
    return mult, offsets % torch.tensor(vocabs, dtype=torch.int64).clamp_min(1)


def build_feature_spec(cfg: DataConfig) -> FeatureSpec:
    """Draw the per-feature parameters (id permutation, dense count distribution) from ``cfg.seed``."""
    schema = data_schema(cfg)
    gen = generator(derive_seed(cfg.seed, "features"))
    id_mult, id_offset = _affine_params(gen, schema.sparse_vocab_sizes)
    seq_mult, seq_offset = _affine_params(gen, schema.sequence_vocab_sizes)
    num_dense = cfg.num_dense
    return FeatureSpec(
        schema=schema, zipf_alpha=cfg.zipf_alpha, multi_hot=cfg.multi_hot,
        vocab=torch.tensor(schema.sparse_vocab_sizes, dtype=torch.int64),
        id_multiplier=id_mult, id_offset=id_offset,
        # Criteo's integer features are counts spanning 0..1e4+ with many zeros/missing: log-normal, wide spread.
        dense_log_mean=torch.rand(num_dense, generator=gen, dtype=torch.float64) * 4.0,
        dense_log_std=0.8 + torch.rand(num_dense, generator=gen, dtype=torch.float64) * 1.2,
        dense_missing=torch.rand(num_dense, generator=gen, dtype=torch.float64) * 0.45,
        seq_multiplier=seq_mult, seq_offset=seq_offset,
    )


@torch.no_grad()
def sample_sparse(spec: FeatureSpec, gen: torch.Generator, batch_size: int) -> KeyedJaggedTensor:
    """Zipf ids, ``multi_hot`` per bag. -> KJT with keys ``schema.sparse_features``, values (F_s * B * m,)."""
    num_sparse, m = len(spec.schema.sparse_features), spec.multi_hot
    uniform = torch.rand(num_sparse, batch_size, m, generator=gen, dtype=torch.float64)  # key-major like KJT
    col = (-1, 1, 1)
    ranks = zipf_ranks(uniform, spec.vocab.view(col), spec.zipf_alpha)
    ids = permute_ids(ranks, spec.id_multiplier.view(col), spec.id_offset.view(col), spec.vocab.view(col))
    return KeyedJaggedTensor(
        keys=list(spec.schema.sparse_features),
        values=ids.reshape(-1),
        lengths=torch.full((num_sparse * batch_size,), m, dtype=torch.int32),
    )


@torch.no_grad()
def sample_sequences(spec: FeatureSpec, gen: torch.Generator, batch_size: int) -> KeyedJaggedTensor:
    """Variable-length Zipf item histories (oldest -> newest). -> KJT with keys ``schema.sequence_features``."""
    schema = spec.schema
    num_seq = len(schema.sequence_features)
    lengths = sequence_lengths(gen, num_seq * batch_size, schema.max_sequence_length)  # (F_q * B,)
    key = torch.repeat_interleave(torch.arange(num_seq), lengths.view(num_seq, batch_size).sum(1))  # (N,)
    vocab = torch.tensor(schema.sequence_vocab_sizes, dtype=torch.int64)[key]
    uniform = torch.rand(key.numel(), generator=gen, dtype=torch.float64)
    ranks = zipf_ranks(uniform, vocab, spec.zipf_alpha)
    items = permute_ids(ranks, spec.seq_multiplier[key], spec.seq_offset[key], vocab)
    return KeyedJaggedTensor(keys=list(schema.sequence_features), values=items, lengths=lengths.int())


@torch.no_grad()
def sample_features(spec: FeatureSpec, gen: torch.Generator, batch_size: int) -> Batch:
    """All input features of one batch; labels are left as zeros (``label_batch`` fills them)."""
    counts = dense_counts(gen, batch_size, spec.dense_log_mean, spec.dense_log_std, spec.dense_missing)
    sparse = sample_sparse(spec, gen, batch_size)
    sequences = sample_sequences(spec, gen, batch_size) if spec.schema.sequence_features else None
    return Batch(dense=dense_from_counts(counts), sparse=sparse, labels=torch.zeros(batch_size), sequences=sequences)


class SyntheticSource:
    """Random access to the synthetic dataset: ``batch_at(split, index, rank=, world_size=)``."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.spec = build_feature_spec(cfg)
        params = draw_teacher_params(
            seed=cfg.seed, num_dense=cfg.num_dense, num_sparse=cfg.num_sparse,
            num_sequences=cfg.num_sequences, latent_dim=cfg.teacher_latent_dim, drift=cfg.drift)
        outliers = cfg.outliers
        self.outlier_scale = (channel_scale(outliers, hot_channels(cfg.seed, cfg.num_dense, outliers.hot_features),
                                            cfg.num_dense) if outliers.enabled else None)  # (F_d,) or None
        calib = sample_features(self.spec, generator(derive_seed(cfg.seed, "calibration")), CALIBRATION_ROWS)
        calib = self._with_outliers(calib, derive_seed(cfg.seed, "calibration", "outliers"))
        calib = self._teacher_view(calib)
        self.teacher: TeacherParams = calibrate_teacher(
            params, calib, target_ctr=cfg.target_ctr, logit_std=cfg.teacher_logit_std)

    def day_of(self, split: str, global_index: int) -> float:
        """Simulated day of a global chunk: train advances one day per ``batches_per_day``; eval stays at day 0."""
        return global_index / self.cfg.batches_per_day if split == "train" else 0.0

    def batch_at(self, split: str, index: int, *, rank: int = 0, world_size: int = 1) -> Batch:
        """Batch ``index`` of ``rank`` in ``split`` ("train" | "eval"), labels drawn from the teacher."""
        global_index = index * world_size + rank
        gen = generator(derive_seed(self.cfg.seed, split, global_index))
        batch = sample_features(self.spec, gen, self.cfg.batch_size)
        batch = self._with_outliers(batch, derive_seed(self.cfg.seed, split, global_index, "outliers"))
        logits = self.logits(batch, self.day_of(split, global_index))
        batch.labels = torch.bernoulli(torch.sigmoid(logits), generator=gen)
        return batch

    def logits(self, batch: Batch, day: float = 0.0) -> torch.Tensor:
        """The teacher's logits for any batch with this schema (e.g. read back from TSV). -> (B,)."""
        return teacher_logits(self.teacher, self._teacher_view(batch), day)

    def _with_outliers(self, batch: Batch, seed: int) -> Batch:
        """``batch`` with ``data.outliers`` applied to its dense features (unchanged when off)."""
        if self.outlier_scale is None:
            return batch
        dense, _ = inject_outliers(batch.dense, self.cfg.outliers, self.outlier_scale, generator(seed))
        return dataclasses.replace(batch, dense=dense)

    def _teacher_view(self, batch: Batch) -> Batch:
        """The batch as the teacher reads it: outliers rescaled and clipped (unchanged when off)."""
        if self.outlier_scale is None:
            return batch
        return dataclasses.replace(batch, dense=teacher_dense(batch.dense, self.outlier_scale))
