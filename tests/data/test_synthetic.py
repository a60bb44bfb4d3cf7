from __future__ import annotations

import dataclasses

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.config import DataConfig
from loka_trainer.data.schema import counts_from_dense, dense_from_counts
from loka_trainer.data.stream import build_stream
from loka_trainer.data.synthetic import SyntheticSource
from .helpers import assert_batches_equal, rank_auc, row_keys

CFG = DataConfig(batch_size=256, eval_batches=3, max_vocab_size=20_000)
SEQ_CFG = dataclasses.replace(CFG, num_sequences=2, max_sequence_length=24, sequence_vocab_size=5_000)


@pytest.fixture(scope="module")
def source() -> SyntheticSource:
    return SyntheticSource(CFG)


@pytest.fixture(scope="module")
def seq_source() -> SyntheticSource:
    return SyntheticSource(SEQ_CFG)


def test_same_seed_same_batches_different_seed_different(source):
    again = SyntheticSource(CFG)
    for index in (0, 7):
        assert_batches_equal(source.batch_at("train", index), again.batch_at("train", index))
    other = SyntheticSource(dataclasses.replace(CFG, seed=1)).batch_at("train", 0)
    first = source.batch_at("train", 0)
    assert not torch.equal(first.dense, other.dense)
    assert not torch.equal(first.sparse.values(), other.sparse.values())


def test_ranks_and_splits_are_disjoint(source):
    streams = [source.batch_at("train", 0, rank=r, world_size=3) for r in range(3)]
    streams.append(source.batch_at("eval", 0, rank=0, world_size=3))
    rows = [row_keys(b) for b in streams]
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert not rows[i] & rows[j]


def test_global_chunks_do_not_depend_on_world_size(source):
    # rank r of W=2, batch i == batch 2i + r of a single rank: resharding keeps the global data order.
    assert_batches_equal(source.batch_at("train", 3, rank=1, world_size=2), source.batch_at("train", 7))


def test_schema_shapes_and_dense_are_log1p_counts(source):
    batch = source.batch_at("train", 0)
    assert batch.dense.shape == (256, 13) and batch.labels.shape == (256,)
    assert batch.sparse.keys() == [f"cat_{i}" for i in range(26)]
    assert batch.sequences is None
    ids = batch.sparse.values().view(26, 256)
    vocab = torch.tensor(source.spec.schema.sparse_vocab_sizes).view(26, 1)
    assert bool((ids >= 0).all()) and bool((ids < vocab).all())
    assert torch.equal(dense_from_counts(counts_from_dense(batch.dense)), batch.dense)
    assert set(batch.labels.unique().tolist()) == {0.0, 1.0}


def test_zipf_skew_present(source):
    ids = torch.cat([source.batch_at("train", i).sparse.values().view(26, 256)[2] for i in range(8)])  # cat_2
    counts = torch.bincount(ids).sort(descending=True).values
    num_rows = ids.numel()
    assert float(counts[:10].sum()) > 0.15 * num_rows  # top-10 of a 20k vocab; uniform would give 0.05%
    assert int((counts == 1).sum()) > 100  # and a long tail of ids seen once


def test_multi_hot_bags():
    batch = SyntheticSource(dataclasses.replace(CFG, multi_hot=3)).batch_at("train", 0)
    assert bool((batch.sparse.lengths() == 3).all())
    assert batch.sparse.values().numel() == 26 * 256 * 3


@pytest.mark.parametrize("source_name", ["source", "seq_source"])
def test_labels_carry_the_teachers_signal(source_name, request):
    source = request.getfixturevalue(source_name)
    batches = [source.batch_at("train", i) for i in range(16)]
    labels = torch.cat([b.labels for b in batches])
    logits = torch.cat([source.logits(b) for b in batches])
    assert 0.2 < float(labels.mean()) < 0.3  # realistic CTR
    assert 0.75 < rank_auc(logits, labels) < 0.87  # Bayes AUC: learnable but far from separable
    shuffled = logits[torch.randperm(logits.numel(), generator=torch.Generator().manual_seed(0))]
    assert abs(rank_auc(shuffled, labels) - 0.5) < 0.05


def test_sequences_have_keys_bounds_and_signal(seq_source):
    batch = seq_source.batch_at("train", 0)
    seqs = batch.sequences
    assert seqs.keys() == ["seq_0", "seq_1"]
    lengths = seqs.lengths()
    assert lengths.numel() == 2 * 256
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= 24 and len(lengths.unique()) > 5
    assert int(seqs.values().min()) >= 0 and int(seqs.values().max()) < 5_000
    # The teacher reads the sequences: giving every row another row's history changes the logits.
    rolled = dataclasses.replace(batch, sequences=seq_source.batch_at("train", 1).sequences)
    delta = seq_source.logits(batch) - seq_source.logits(rolled)
    assert float(delta.abs().mean()) > 0.1


def test_sequence_order_matters(seq_source):
    # Reversing every history keeps the bag of items but changes which ones are recent: a model that reads the
    # order has signal that a bag-of-items model lacks.
    batch = seq_source.batch_at("train", 0)
    seqs = batch.sequences
    lengths = seqs.lengths().long()
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    ends = torch.repeat_interleave(torch.cumsum(lengths, 0), lengths)
    pos = torch.arange(lengths.sum())
    reversed_values = seqs.values()[starts + (ends - 1 - pos)]
    flipped = dataclasses.replace(batch, sequences=KeyedJaggedTensor(
        keys=seqs.keys(), values=reversed_values, lengths=seqs.lengths()))
    delta = (seq_source.logits(batch) - seq_source.logits(flipped)).abs()
    single = lengths.view(2, -1).max(0).values == 1  # rows whose histories are all one item cannot change
    assert float(delta[~single].mean()) > 0.1
    assert bool((delta[single] < 1e-5).all())


def test_drift_changes_the_teacher_over_days_only_when_on(source):
    batch = source.batch_at("eval", 0)
    assert torch.equal(source.logits(batch, day=0.0), source.logits(batch, day=5.0))
    drifting = SyntheticSource(dataclasses.replace(CFG, drift=0.2))
    day0, day5 = drifting.logits(batch, day=0.0), drifting.logits(batch, day=5.0)
    assert float((day0 - day5).abs().mean()) > 0.2
    assert float(torch.corrcoef(torch.stack([day0, day5]))[0, 1]) > 0.2  # slow: still related after 5 days


def test_stream_resume_is_exact_and_o1():
    stream = build_stream(CFG, split="train", rank=1, world_size=2)
    expected = [next(stream) for _ in range(4)]
    resumed = build_stream(CFG, split="train", rank=1, world_size=2)
    resumed.load_state_dict({**resumed.state_dict(), "position": 2})
    assert_batches_equal(next(resumed), expected[2])
    assert_batches_equal(next(resumed), expected[3])
    assert resumed.state_dict()["position"] == 4
    far = build_stream(CFG, split="train", rank=1, world_size=2)
    far.load_state_dict({**far.state_dict(), "position": 10**9})  # no replay of earlier batches
    assert len(next(far)) == 256


def test_teacher_logits_stay_finite_over_many_rows(seq_source):
    # Millions of hashed words: enough to hit the extreme ends of the hash range if they were mishandled.
    for index in range(40):
        batch = seq_source.batch_at("train", index)
        assert bool(torch.isfinite(seq_source.logits(batch)).all())
