"""Registry errors and the Hydra yaml files of conf/model/ (composed against their schemas)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from loka_trainer.models.zoo import MODELS, build_model

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
YAMLS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def test_unknown_model_name_lists_valid_names(schema, small_config):
    cfg = dataclasses.replace(small_config("dlrm"), name="dlrm2")
    with pytest.raises(ValueError, match="dlrm_dcnv2"):
        build_model(cfg, schema=schema, loka_mods=False)


def test_config_of_the_wrong_type_is_rejected(schema, small_config):
    with pytest.raises(TypeError, match="WukongConfig"):
        build_model(dataclasses.replace(small_config("dlrm"), name="wukong"), schema=schema, loka_mods=False)


def test_every_config_name_matches_its_registry_key():
    assert set(MODELS) == {"dlrm", "dlrm_dcnv2", "wukong", "interformer"}
    for name, spec in MODELS.items():
        assert spec.config_cls().name == name


@pytest.mark.parametrize(
    "name,overrides,match",
    [("dlrm", {"dense_arch_widths": [16, 4]}, "dense_arch_widths"),
     ("interformer", {"num_recent_tokens": 99}, "num_recent_tokens"),
     ("interformer", {"num_heads": 3}, "num_heads"),
     ("wukong", {"num_layers": 0}, "num_layers")],
)
def test_bad_sizes_raise_naming_the_field(name, overrides, match, schema, small_config):
    with pytest.raises(ValueError, match=match):
        build_model(small_config(name, **overrides), schema=schema, loka_mods=False)


def test_interformer_needs_sequences(schema, batch, small_config):
    model = build_model(small_config("interformer"), schema=schema, loka_mods=False)
    with pytest.raises(ValueError, match="sequences"):
        model(dataclasses.replace(batch, sequences=None))


@pytest.fixture(scope="module")
def _registered_schemas():
    for name, spec in MODELS.items():  # what config.register_schemas does: schemas at the config root
        ConfigStore.instance().store(name=f"{name}_schema", node=spec.config_cls)


@pytest.mark.parametrize("yaml_name", YAMLS)
def test_yaml_composes_and_builds(yaml_name, _registered_schemas, make_schema, make_batch):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name=None, overrides=[f"+model={yaml_name}", "model.mods.norm=blocknorm"])
    model_cfg = OmegaConf.to_object(cfg.model)
    assert isinstance(model_cfg, MODELS[model_cfg.name].config_cls)
    assert model_cfg.mods.norm == "blocknorm"
    schema = make_schema(vocab=50)
    batch = make_batch(schema, 3)
    with torch.no_grad():
        assert build_model(model_cfg, schema=schema, loka_mods=True)(batch).shape == (3,)


def _biased(model) -> set:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.bias is not None}


def test_keep_bias_that_names_no_linear_is_a_typo(schema, small_config):
    from loka_trainer.models.mods import ModsConfig

    cfg = small_config("wukong", mods=ModsConfig(keep_bias=["over_arch.mlpp.*"]))
    with pytest.raises(ValueError, match="model.mods.keep_bias"):
        build_model(cfg, schema=schema, loka_mods=True)


def test_keep_bias_on_already_biased_linears_is_a_no_op(schema, small_config):
    from loka_trainer.models.mods import ModsConfig

    plain = build_model(small_config("dlrm", mods=ModsConfig(bias=True)), schema=schema, loka_mods=False)
    kept = build_model(small_config("dlrm", mods=ModsConfig(bias=True, keep_bias=["over_arch.*"])), schema=schema,
                       loka_mods=False)
    assert _biased(kept) == _biased(plain) and len(_biased(kept)) > 1


def test_interformer_default_keeps_only_the_merge_and_prediction_bias_under_loka(schema, small_config):
    torch.manual_seed(0)
    model = build_model(small_config("interformer"), schema=schema, loka_mods=True)
    assert _biased(model) == {"input_arch.merge", "head_arch.over_arch.prediction"}
    bias, bound = model.input_arch.merge.bias, model.input_arch.merge.in_features ** -0.5
    assert 0 < bias.abs().min() and bias.abs().max() <= bound  # drawn like nn.Linear's, not zero
    published = build_model(small_config("interformer"), schema=schema, loka_mods=False)
    assert "input_arch.merge" in _biased(published) and len(_biased(published)) > 2


@pytest.mark.parametrize("yaml_name", ["interformer", "interformer_paper"])
def test_interformer_yamls_keep_the_merge_bias(yaml_name, _registered_schemas):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name=None, overrides=[f"+model={yaml_name}"])
    mods = OmegaConf.to_object(cfg.model).mods
    assert (list(mods.keep_bias), mods.keep_bias_init) == (["input_arch.merge"], "linear")
