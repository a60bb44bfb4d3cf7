from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from loka_trainer.data.config import DataConfig, OutlierConfig
from loka_trainer.data.hashing import derive_seed, generator
from loka_trainer.data.outliers import MAX_REGULAR_DENSE, hot_channels
from loka_trainer.data.synthetic import SyntheticSource, sample_features
from loka_trainer.data.teacher import teacher_logits
from .helpers import assert_batches_equal, rank_auc, row_keys

CFG = DataConfig(batch_size=512, eval_batches=3, max_vocab_size=20_000)
OUTLIERS = OutlierConfig(spike_rate=0.01, spike_min=100.0, spike_max=10_000.0, hot_features=2, hot_scale=100.0)
ON = dataclasses.replace(CFG, outliers=OUTLIERS)


@pytest.fixture(scope="module")
def plain() -> SyntheticSource:
    return SyntheticSource(CFG)


@pytest.fixture(scope="module")
def noisy() -> SyntheticSource:
    return SyntheticSource(ON)


def test_off_is_the_stream_without_the_knob(plain):
    # The default config equals one with every outlier field at its default, and its batches are those of a
    # source that never looks at outliers: the same dense bits, ids and labels.
    assert not CFG.outliers.enabled
    explicit = SyntheticSource(dataclasses.replace(CFG, outliers=OutlierConfig(spike_rate=0.0, hot_features=0)))
    for index in (0, 5):
        assert_batches_equal(plain.batch_at("train", index), explicit.batch_at("train", index))
    assert plain.outlier_scale is None
    # ... and the stream layout of the module docstring, built here from its parts without any outlier code.
    gen = generator(derive_seed(CFG.seed, "train", 5))
    expected = sample_features(plain.spec, gen, CFG.batch_size)
    expected.labels = torch.bernoulli(torch.sigmoid(teacher_logits(plain.teacher, expected)), generator=gen)
    assert_batches_equal(plain.batch_at("train", 5), expected)


def test_on_keeps_the_rows_and_adds_the_stated_outliers(plain, noisy):
    hot = hot_channels(CFG.seed, CFG.num_dense, 2)
    cold = torch.ones(CFG.num_dense, dtype=torch.bool)
    cold[hot] = False
    base = torch.cat([plain.batch_at("train", i).dense for i in range(8)])  # (4096, F_d)
    dense = torch.cat([noisy.batch_at("train", i).dense for i in range(8)])
    ratio = dense / base.clamp_min(1.0)
    spikes = ratio[:, cold] >= 99.0  # a spike is >= spike_min times the value (>= 1); otherwise ratio <= 1
    assert torch.equal(dense[:, cold][~spikes], base[:, cold][~spikes])  # non-spiked values untouched
    rate = float(spikes.double().mean())
    assert 0.007 < rate < 0.013  # spike_rate 0.01 over ~45k values
    magnitudes = ratio[:, cold][spikes]
    assert float(magnitudes.min()) >= 99.9 and float(magnitudes.max()) <= 10_000.1
    assert float(magnitudes.log10().median()) == pytest.approx(3.0, abs=0.25)  # log-uniform in [1e2, 1e4]
    # Hot channels: exactly hot_scale times the base value wherever they did not spike.
    hot_ratio = dense[:, hot] / base[:, hot]
    regular = (dense[:, hot] < 100.0 * MAX_REGULAR_DENSE * 1.0001) & (base[:, hot] > 0)
    assert torch.allclose(hot_ratio[regular], torch.full_like(hot_ratio[regular], 100.0))
    assert float(dense[:, hot].abs().mean()) > 30 * float(dense[:, cold][~spikes].abs().mean())


def test_on_is_deterministic_per_seed_and_disjoint_per_rank(noisy):
    again = SyntheticSource(ON)
    assert_batches_equal(noisy.batch_at("train", 3, rank=1, world_size=2), again.batch_at("train", 3, rank=1,
                                                                                           world_size=2))
    assert_batches_equal(noisy.batch_at("train", 3, rank=1, world_size=2), noisy.batch_at("train", 7))
    other = SyntheticSource(dataclasses.replace(ON, seed=1)).batch_at("train", 0)
    assert not torch.equal(other.dense, noisy.batch_at("train", 0).dense)
    rows = [row_keys(noisy.batch_at("train", 0, rank=r, world_size=3)) for r in range(3)]
    rows.append(row_keys(noisy.batch_at("eval", 0, rank=0, world_size=3)))
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            assert not rows[i] & rows[j]


def test_teacher_stays_learnable_with_outliers(noisy):
    batches = [noisy.batch_at("train", i) for i in range(16)]
    labels = torch.cat([b.labels for b in batches])
    logits = torch.cat([noisy.logits(b) for b in batches])
    assert bool(torch.isfinite(logits).all())
    assert 0.2 < float(labels.mean()) < 0.3
    assert 0.75 < rank_auc(logits, labels) < 0.87


def test_hot_channels_depend_on_seed_and_count():
    a, b = hot_channels(0, 13, 3), hot_channels(0, 13, 3)
    assert torch.equal(a, b) and a.numel() == 3 and len(set(a.tolist())) == 3
    assert bool((a >= 0).all()) and bool((a < 13).all())
    assert not all(torch.equal(hot_channels(s, 13, 3), a) for s in range(1, 6))
    assert math.isclose(MAX_REGULAR_DENSE, math.log1p(100_000))


@pytest.mark.parametrize("changes, message", [
    ({"spike_rate": -0.1}, "data.outliers.spike_rate must be in"),
    ({"spike_rate": 1.5}, "data.outliers.spike_rate must be in"),
    ({"spike_min": 0.5}, "spike_min and spike_max"),
    ({"spike_min": 1e4, "spike_max": 1e2}, "spike_min and spike_max"),
    ({"hot_features": 14}, "data.outliers.hot_features must be in"),
    ({"hot_features": -1}, "data.outliers.hot_features must be in"),
    ({"hot_scale": 0.0}, "data.outliers.hot_scale must be > 0"),
])
def test_validate_rejects_bad_outlier_fields_in_one_line(changes, message):
    cfg = dataclasses.replace(CFG, outliers=dataclasses.replace(OUTLIERS, **changes))
    with pytest.raises(ValueError, match=message) as err:
        cfg.validate()
    assert "\n" not in str(err.value)


def test_criteo_refuses_outliers(tmp_path):
    tsv = tmp_path / "train.txt"
    tsv.write_text("")
    cfg = dataclasses.replace(ON, name="criteo", path=str(tsv))
    with pytest.raises(ValueError, match="data.outliers is synthetic only"):
        cfg.validate()
    dataclasses.replace(cfg, outliers=OutlierConfig()).validate()
