"""Checks of a composed run config across its groups (``loka_trainer.run_checks``): the model against the data,
a preset against its name, settings nothing reads named in the log."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize("overrides, line", [
    (["model=dlrm", "data.num_sequences=2"], "model=dlrm does not read behaviour sequences: the data's "
     "data.num_sequences=2 are generated (and shape its labels) but never seen by the model"),
    (["model=wukong"], None),
    (["model=interformer"], None),  # it reads them (data.num_sequences follows model.num_sequences)
])
def test_sequences_a_model_does_not_read_are_named(overrides, line):
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.run_checks import unread_sequences

    register_schemas()
    assert unread_sequences(to_run_config(compose_config("config", overrides)[0])) == line


@pytest.mark.parametrize("schema, name, message", [
    ("dlrm_dcnv2", "dlrm", "model.name='dlrm' does not pick the model: this preset's schema is 'dlrm_dcnv2' "
                           "(model.name must stay 'dlrm_dcnv2'); choose a model with model=dlrm"),
    ("dlrm", "wukong", "choose a model with model=wukong"),
    ("wukong", "wukong_h200", "choose a model with model=wukong_h200"),
    ("interformer", "bert", "choose a model with model=<preset>, one of dlrm, dlrm_dcnv2"),
])
def test_model_name_that_is_not_the_presets_model_is_refused_naming_model_eq(schema, name, message):
    """A dlrm_dcnv2 config named dlrm built a plain DLRM, its cross net settings unread; a dlrm config named wukong
    failed in the builder with a message about OmegaConf.to_object."""
    from loka_trainer.run_checks import check_model_name
    from loka_trainer.models.configs import MODEL_CONFIGS
    with pytest.raises(ValueError) as err:
        check_model_name(MODEL_CONFIGS[schema](name=name))
    assert message in str(err.value), str(err.value)
    for cls in MODEL_CONFIGS.values():
        check_model_name(cls())


@pytest.mark.parametrize("model_seqs, data_seqs", [(2, 5), (3, 1)])
def test_data_sequences_other_than_the_models_are_refused_naming_both(model_seqs, data_seqs):
    """InterFormer is built for every sequence the data provides: data.num_sequences=5 under model.num_sequences=2
    trained a 5-sequence model, model.num_sequences unread."""
    from loka_trainer.run_checks import check_data_has_the_model_sequences
    from loka_trainer.data.config import DataConfig
    from loka_trainer.models.configs import DLRMConfig, InterFormerConfig

    def run(model, data_seqs):
        return argparse.Namespace(model=model, data=DataConfig(num_sequences=data_seqs))

    with pytest.raises(ValueError) as err:
        check_data_has_the_model_sequences(run(InterFormerConfig(num_sequences=model_seqs), data_seqs))
    assert str(err.value).startswith(f"model.num_sequences={model_seqs} but data.num_sequences={data_seqs}: "
                                     f"model=interformer reads every sequence the data provides"), str(err.value)
    assert f"set model.num_sequences={data_seqs}" in str(err.value)
    check_data_has_the_model_sequences(run(InterFormerConfig(num_sequences=model_seqs), model_seqs))
    check_data_has_the_model_sequences(run(DLRMConfig(), 0))


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp32", "precision.name=loka"], "precision.name='loka' does not pick the precision: it labels the "
     "run and stays the preset's own (precision.name must stay 'fp32' under precision=fp32); choose one with "
     "precision=loka"),
    (["precision=fp8_tensorwise", "precision.name=mine"], "choose one with precision=<preset>, one of bf16, fp32, "
     "fp8_rowwise, fp8_rowwise_gw_hp, fp8_tensorwise, loka"),
    (["sharding=auto", "sharding.name=table_wise"], "sharding.name='table_wise' does not pick the sharding: it "
     "labels the run and stays the preset's own (sharding.name must stay 'auto' under sharding=auto); choose one "
     "with sharding=table_wise"),
])
def test_a_precision_or_sharding_name_that_is_not_the_presets_own_is_refused(overrides, message):
    """precision.name=loka under precision=fp32 ran fp32 labelled loka in summary.json and the logs."""
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config

    register_schemas()
    with pytest.raises(ValueError) as err:
        to_run_config(compose_config("config", overrides)[0])
    assert message in str(err.value), str(err.value)


def test_every_precision_variant_and_preset_composes_under_its_own_name():
    """scripts.train_runs' variants are presets plus overrides: each keeps its preset's name; the presets run as
    their names say, the variants without Dispatch are named in train.log (`precision.not_as_named`)."""
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.precision import PRESET_RUNS_AS, not_as_named
    from scripts.train_runs import known_variants, precision_overrides

    register_schemas()
    assert set(PRESET_RUNS_AS) == {p.stem for p in (Path(__file__).parents[1] / "conf" / "precision").glob("*.yaml")}
    lines = {}
    for variant in known_variants():
        overrides = precision_overrides(variant)
        run = to_run_config(compose_config("config", [*overrides, "sharding=table_wise"])[0])
        assert (run.precision.name, run.sharding.name) == (overrides[0].split("=")[1], "table_wise"), variant
        lines[variant] = not_as_named(run.precision)
    assert {v for v, line in lines.items() if line} == {"bf16_mods", "bf16_mods_bias", "bf16_mods_layernorm",
                                                        "bf16_mods_silu"}
    assert lines["bf16_mods"] == ("precision=loka runs as bfloat16 autocast with the Mods, not LoKA Dispatch "
                                  "(precision.fp8_recipe=null, precision.dispatch=false, "
                                  "precision.compute_dtype=bfloat16); summary.json and the logs keep the name loka")


@pytest.mark.parametrize("overrides, line", [
    (["precision=fp8_tensorwise", "precision.fp8_recipe=null"], "precision=fp8_tensorwise runs as bfloat16 "
     "autocast, not torchao float8 tensorwise (precision.fp8_recipe=null, precision.dispatch=false, "
     "precision.compute_dtype=bfloat16); summary.json and the logs keep the name fp8_tensorwise"),
    (["precision=fp8_rowwise", "precision.fp8_recipe=tensorwise"], "precision=fp8_rowwise runs as torchao float8 "
     "tensorwise, not torchao float8 rowwise (precision.fp8_recipe=tensorwise)"),
    (["precision=bf16", "precision.compute_dtype=float32"], "precision=bf16 runs as float32, not bfloat16 autocast"),
    (["precision=fp32", "precision.fp8_recipe=rowwise"], "precision=fp32 runs as torchao float8 rowwise, not float32"),
    (["precision=loka", "precision.mods=false"], None),
    (["precision=fp8_rowwise", "precision.fp8_filter=auto"], None),
])
def test_a_preset_whose_defining_setting_is_overridden_away_is_named_in_train_log(overrides, line):
    """precision=fp8_tensorwise precision.fp8_recipe=null ran BF16 labelled fp8_tensorwise, with nothing said."""
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.precision import apply_precision, not_as_named

    register_schemas()
    config = to_run_config(compose_config("config", overrides)[0]).precision
    named = not_as_named(config)
    assert named is None if line is None else named.startswith(line), named
    if not config.dispatch:  # Dispatch would measure a plan first
        logged: list[str] = []
        apply_precision(torch.nn.Sequential(torch.nn.Linear(32, 32)), config=config, device="cpu", log=logged.append)
        assert (named in logged) == (line is not None), logged
