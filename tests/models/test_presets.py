"""``preset_config``: a ``conf/model`` preset as scripts build it is the model node train.py composes."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from loka_trainer.cli import compose_config
from loka_trainer.config import register_schemas, to_run_config
from loka_trainer.models.configs import MODEL_CONFIGS, PRESETS_DIR, WukongConfig, preset_config, preset_model_node

PRESETS = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_what_train_py_composes(name):
    register_schemas()
    composed = to_run_config(compose_config("config", [f"model={name}"])[0]).model
    built = preset_config(name)
    schema = MODEL_CONFIGS[preset_model_node(OmegaConf.load(PRESETS_DIR / f"{name}.yaml")).name]
    assert type(built) is type(composed) is schema
    assert dataclasses.asdict(built) == dataclasses.asdict(composed)


def test_sized_preset_takes_its_schema_from_its_name():
    cfg = preset_config("wukong_h200")
    assert isinstance(cfg, WukongConfig)
    assert (cfg.embedding_dim, cfg.num_layers, cfg.fmb_widths) == (256, 4, [4096, 4096])
    assert cfg != WukongConfig()


def test_unknown_preset_is_one_line():
    with pytest.raises(ValueError, match="no wukong_h100.yaml") as err:
        preset_config("wukong_h200".replace("200", "100"))
    assert "\n" not in str(err.value) and "wukong_h200" in str(err.value)


@pytest.mark.parametrize("overrides, warmup", [
    (["model=interformer_h200"], 200),                            # the preset's own trainer default
    (["model=interformer_h200", "trainer.warmup_steps=0"], 0),    # the command line still wins
    (["trainer.warmup_steps=50", "model=interformer_h200"], 50),  # whatever the order on it
    (["model=wukong_h200"], 0),
])
def test_a_preset_may_set_a_trainer_default_that_the_command_line_overrides(overrides, warmup):
    register_schemas()
    run = to_run_config(compose_config("config", overrides)[0])
    assert run.trainer.warmup_steps == warmup
    assert run.model.embedding_dim == 256  # the preset's model node still lands under model
