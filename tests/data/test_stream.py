from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from loka_trainer.data import DATA_SOURCES, DataConfig, build_stream, data_schema
from loka_trainer.data.config import SOURCE_NAMES

from .helpers import assert_batches_equal

CFG = DataConfig(batch_size=64, eval_batches=3, max_vocab_size=5_000, num_sequences=1, max_sequence_length=8)


def test_registry_matches_config_names():
    assert tuple(DATA_SOURCES) == SOURCE_NAMES


@pytest.mark.parametrize("kwargs, message", [
    ({"split": "test", "rank": 0, "world_size": 1}, "split must be one of ['train', 'eval']"),
    ({"split": "train", "rank": 2, "world_size": 2}, "rank must be in [0, world_size)"),
    ({"split": "train", "rank": 0, "world_size": 0}, "rank must be in [0, world_size)"),
])
def test_build_stream_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_stream(CFG, **kwargs)


def test_build_stream_validates_config():
    with pytest.raises(ValueError, match="data.batch_size must be > 0"):
        build_stream(dataclasses.replace(CFG, batch_size=0), split="train", rank=0, world_size=1)


def test_schema_matches_the_batches():
    schema = data_schema(CFG)
    batch = next(build_stream(CFG, split="train", rank=0, world_size=1))
    assert batch.dense.shape[1] == schema.num_dense
    assert tuple(batch.sparse.keys()) == schema.sparse_features
    assert tuple(batch.sequences.keys()) == schema.sequence_features
    assert int(batch.sequences.lengths().max()) <= schema.max_sequence_length
    assert schema.sparse_vocab_sizes[2] == 5_000 and schema.sparse_vocab_sizes[8] == 3  # capped / real Criteo


def test_eval_stream_is_finite_and_restartable():
    stream = build_stream(CFG, split="eval", rank=0, world_size=1)
    assert len(stream) == 3
    first, second = list(stream), list(stream)
    assert len(first) == len(second) == 3
    for a, b in zip(first, second):
        assert_batches_equal(a, b)


def test_train_stream_is_infinite_and_iter_does_not_rewind():
    stream = build_stream(CFG, split="train", rank=0, world_size=1)
    first = next(iter(stream))
    second = next(iter(stream))
    assert not torch.equal(first.dense, second.dense)
    with pytest.raises(TypeError):
        len(stream)
    assert stream.num_malformed == 0


def test_state_from_another_stream_is_refused():
    state = build_stream(CFG, split="train", rank=0, world_size=2).state_dict()
    other = build_stream(CFG, split="train", rank=0, world_size=4)
    with pytest.raises(ValueError, match="world_size=2 but this stream has world_size=4"):
        other.load_state_dict(state)
    reseeded = build_stream(dataclasses.replace(CFG, seed=3), split="train", rank=0, world_size=2)
    with pytest.raises(ValueError, match="seed"):
        reseeded.load_state_dict(state)
