from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from loka_trainer.data import DATA_SOURCES, DataConfig, build_stream, data_schema
from loka_trainer.data.config import SOURCE_NAMES, OutlierConfig

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


# A value other than CFG's for every DataConfig setting that decides the synthetic batches
OTHER_DATA = {"seed": 1, "batch_size": 32, "num_dense": 12, "num_sparse": 25, "max_vocab_size": 4_000,
              "zipf_alpha": 1.2, "multi_hot": 2, "num_sequences": 2, "max_sequence_length": 6,
              "sequence_vocab_size": 50_000, "target_ctr": 0.3, "teacher_logit_std": 1.0, "teacher_latent_dim": 4,
              "drift": 0.1, "batches_per_day": 100}
OTHER_OUTLIERS = {"spike_rate": 0.01, "spike_min": 10.0, "spike_max": 1_000.0, "hot_features": 2, "hot_scale": 10.0}


def test_every_setting_outside_the_batch_independent_ones_is_in_the_synthetic_identity():
    from loka_trainer.data.stream import SYNTHETIC_BATCH_INDEPENDENT, synthetic_identity

    batch_deciding = {f.name for f in dataclasses.fields(DataConfig)} - set(SYNTHETIC_BATCH_INDEPENDENT)
    assert batch_deciding == set(OTHER_DATA) | {"outliers"}
    assert {f.name for f in dataclasses.fields(OutlierConfig)} == set(OTHER_OUTLIERS)
    base = synthetic_identity(CFG)
    for field, value in OTHER_DATA.items():
        changed = synthetic_identity(dataclasses.replace(CFG, **{field: value}))
        assert {k for k in base if base[k] != changed[k]} == {field}
    for field, value in OTHER_OUTLIERS.items():
        changed = synthetic_identity(dataclasses.replace(CFG, outliers=OutlierConfig(**{field: value})))
        assert {k for k in base if base[k] != changed[k]} == {f"outliers.{field}"}


@pytest.mark.parametrize("changes", [{"eval_batches": 7}, {"prefetch": 0}, {"workers": 3}, {"pin_memory": False},
                                     {"eval_fraction": 0.5}])
def test_batch_independent_settings_leave_the_synthetic_batches_as_they_are(changes):
    a = build_stream(CFG, split="train", rank=0, world_size=1)
    b = build_stream(dataclasses.replace(CFG, **changes), split="train", rank=0, world_size=1)
    assert_batches_equal(next(a), next(b))
    b.load_state_dict(a.state_dict())  # a resume with them changed goes on


@pytest.mark.parametrize("changes, message", [
    ({"outliers": OutlierConfig(spike_rate=0.01)}, "outliers.spike_rate=0.0 but this stream has "
                                                   "outliers.spike_rate=0.01"),
    ({"target_ctr": 0.3}, "target_ctr=0.25 but this stream has target_ctr=0.3"),
    ({"teacher_logit_std": 1.0}, "teacher_logit_std=1.35 but this stream has teacher_logit_std=1.0"),
    ({"zipf_alpha": 1.3}, "zipf_alpha=1.1 but this stream has zipf_alpha=1.3"),
    ({"drift": 0.5}, "drift=0.0 but this stream has drift=0.5"),
])
def test_state_of_other_synthetic_data_is_refused(changes, message):
    state = build_stream(CFG, split="train", rank=0, world_size=1).state_dict()
    other = build_stream(dataclasses.replace(CFG, **changes), split="train", rank=0, world_size=1)
    with pytest.raises(ValueError, match=re.escape(message)):
        other.load_state_dict(state)


def test_a_state_that_does_not_record_a_setting_resumes_with_a_warning_naming_it(caplog):
    stream = build_stream(CFG, split="train", rank=0, world_size=1)
    next(stream)
    older = {key: value for key, value in stream.state_dict().items() if key != "outliers.spike_rate"}
    resumed = build_stream(CFG, split="train", rank=0, world_size=1)
    with caplog.at_level(logging.WARNING, logger="loka_trainer"):
        resumed.load_state_dict(older)  # a checkpoint written before the setting was recorded
    assert "data stream state records no outliers.spike_rate" in caplog.text
    assert_batches_equal(next(resumed), next(stream))  # where it was
