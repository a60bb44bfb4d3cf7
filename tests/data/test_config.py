from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from loka_trainer.data.config import DataConfig, OutlierConfig

CONF_DATA = Path(__file__).resolve().parents[2] / "conf" / "data"


def test_defaults_are_valid():
    DataConfig().validate()


@pytest.mark.parametrize("changes, message", [
    ({"batch_size": -3}, "data.batch_size must be > 0, got -3"),
    ({"batch_size": 0}, "data.batch_size must be > 0, got 0"),
    ({"name": "avazu"}, "data.name must be one of ['synthetic', 'criteo'], got 'avazu'"),
    ({"multi_hot": 0}, "data.multi_hot must be > 0"),
    ({"num_sequences": -1}, "data.num_sequences must be >= 0"),
    ({"zipf_alpha": -0.5}, "data.zipf_alpha must be >= 0.0"),
    ({"target_ctr": 1.5}, "data.target_ctr must be in (0, 1)"),
    ({"eval_batches": -1}, "data.eval_batches must be >= 0"),
    ({"workers": 0}, "data.workers must be >= 1, got 0"),
    ({"name": "criteo"}, "data.path must be set"),
    ({"name": "criteo", "path": "/nonexistent/train.txt"}, "data.path must be an existing Criteo TSV file"),
])
def test_validate_rejects_with_one_line_message(changes, message):
    cfg = dataclasses.replace(DataConfig(), **changes)
    with pytest.raises(ValueError) as err:
        cfg.validate()
    assert message in str(err.value)
    assert "\n" not in str(err.value)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("changes, message", [
    ({"drift": NAN}, "data.drift must be a finite number, got nan"),
    ({"drift": INF}, "data.drift must be a finite number, got inf"),
    ({"teacher_logit_std": NAN}, "data.teacher_logit_std must be a finite number, got nan"),
    ({"zipf_alpha": INF}, "data.zipf_alpha must be a finite number, got inf"),
    ({"target_ctr": NAN}, "data.target_ctr must be a finite number, got nan"),
    ({"outliers": OutlierConfig(hot_scale=INF, hot_features=2)}, "data.outliers.hot_scale must be a finite number"),
    ({"outliers": OutlierConfig(spike_max=INF, spike_rate=0.1)}, "data.outliers.spike_max must be a finite number"),
    ({"outliers": OutlierConfig(spike_rate=NAN)}, "data.outliers.spike_rate must be a finite number, got nan"),
])
def test_non_finite_numbers_are_rejected_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(DataConfig(), **changes).validate()


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_every_float_field_must_be_finite(value):
    floats = [(f.name, None) for f in dataclasses.fields(DataConfig) if f.type == "float"]
    floats += [("outliers", f.name) for f in dataclasses.fields(OutlierConfig) if f.type == "float"]
    assert len(floats) == 9
    for field, sub in floats:
        changes = {field: value} if sub is None else {"outliers": OutlierConfig(**{sub: value})}
        name = field if sub is None else f"outliers.{sub}"
        with pytest.raises(ValueError, match=re.escape(f"data.{name} must be a finite number")):
            dataclasses.replace(DataConfig(), **changes).validate()


@pytest.mark.parametrize("field, value", [("multi_hot", 2), ("num_sequences", 1), ("num_sparse", 8)])
def test_criteo_rejects_non_criteo_shapes(tmp_path, field, value):
    path = tmp_path / "train.txt"
    path.write_text("")
    cfg = dataclasses.replace(DataConfig(name="criteo", path=str(path)), **{field: value})
    with pytest.raises(ValueError, match=f"data.{field} must be"):
        cfg.validate()


def test_criteo_validation_only_checks_existence(tmp_path):
    path = tmp_path / "train.txt"
    path.write_bytes(b"\xff not a criteo file at all\n")  # contents are never read by validate()
    DataConfig(name="criteo", path=str(path)).validate()
    with pytest.raises(ValueError, match="data.eval_path must be an existing"):
        DataConfig(name="criteo", path=str(path), eval_path=str(tmp_path / "missing.txt")).validate()
    with pytest.raises(ValueError, match="data.eval_fraction must be in"):
        DataConfig(name="criteo", path=str(path), eval_fraction=0.0).validate()


@pytest.fixture
def hydra_conf(tmp_path):
    """A throwaway primary config that uses the real ``conf/data`` group against the ``DataConfig`` schema."""
    shutil.copytree(CONF_DATA, tmp_path / "data")
    (tmp_path / "config.yaml").write_text("defaults:\n  - data: synthetic\n  - _self_\n")
    ConfigStore.instance().store(name="data_schema", node=DataConfig)  # at the root, as register_schemas does
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        yield tmp_path
    GlobalHydra.instance().clear()


def test_yaml_groups_compose_against_schema(hydra_conf):
    synthetic = OmegaConf.to_object(compose("config", overrides=["data.batch_size=64"]).data)
    assert isinstance(synthetic, DataConfig) and synthetic.batch_size == 64
    synthetic.validate()
    tsv = hydra_conf / "train.txt"
    tsv.write_text("")
    criteo = OmegaConf.to_object(compose("config", overrides=["data=criteo", f"data.path={tsv}"]).data)
    assert criteo.name == "criteo"
    criteo.validate()
    with pytest.raises(ValueError, match="data.path must be set"):
        OmegaConf.to_object(compose("config", overrides=["data=criteo"]).data).validate()


def test_yaml_schema_rejects_unknown_keys_and_bad_types(hydra_conf):
    with pytest.raises(Exception, match="not_a_field"):
        compose("config", overrides=["data.not_a_field=1"])
    with pytest.raises(Exception, match="batch_size"):
        compose("config", overrides=["data.batch_size=lots"])


def test_yaml_outliers_group_composes_and_validates(hydra_conf):
    cfg = OmegaConf.to_object(compose("config", overrides=["data.outliers.spike_rate=0.001",
                                                           "data.outliers.hot_features=2"]).data)
    assert cfg.outliers.enabled and cfg.outliers.spike_rate == 0.001 and cfg.outliers.hot_features == 2
    cfg.validate()
    assert not OmegaConf.to_object(compose("config").data).outliers.enabled
    with pytest.raises(Exception, match="spike_rat"):
        compose("config", overrides=["data.outliers.spike_rat=0.1"])


def test_settings_the_source_does_not_read_are_named():
    from loka_trainer.data.config import SOURCE_NAMES, UNREAD_BY_SOURCE
    assert sorted(UNREAD_BY_SOURCE) == sorted(SOURCE_NAMES)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    assert all(set(unread) <= fields for unread in UNREAD_BY_SOURCE.values())
    assert DataConfig().unread_settings() == []
    assert DataConfig(eval_fraction=0.2, drift=0.5).unread_settings() == ["data.eval_fraction"]
    assert DataConfig(name="criteo", path="x", drift=0.5, seed=3, eval_fraction=0.2).unread_settings() == [
        "data.seed", "data.drift"]
