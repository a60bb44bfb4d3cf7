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
    composed = compose_config("config", overrides)
    with pytest.raises(ValueError) as err:
        to_run_config(composed.cfg, composed.choices)
    assert message in str(err.value), str(err.value)


def test_the_preset_name_check_reads_the_choices_of_the_config_it_checks():
    """It read the choices of the config Hydra composed last: a precision=loka config checked after a precision=fp32
    one was composed was refused (precision.name must stay 'fp32'), and a renamed one passed after a renaming
    one."""
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config

    register_schemas()
    loka = compose_config("config", ["precision=loka"])
    renamed = compose_config("config", ["precision=fp32", "precision.name=loka"])
    assert to_run_config(loka.cfg, loka.choices).precision.name == "loka"
    with pytest.raises(ValueError, match="precision.name must stay 'fp32' under precision=fp32"):
        to_run_config(renamed.cfg, renamed.choices)
    compose_config("config", ["precision=loka"])
    with pytest.raises(ValueError, match="precision.name must stay 'fp32' under precision=fp32"):
        to_run_config(renamed.cfg, renamed.choices)
    assert to_run_config(renamed.cfg).precision.name == "loka"  # no choices: no name is checked against a preset


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


def _memory_run(device_model=None, **data):
    from loka_trainer.data.config import DataConfig
    from loka_trainer.models.configs import DLRMConfig

    return argparse.Namespace(data=DataConfig(**data), model=device_model or DLRMConfig(embedding_dim=16))


def test_a_batch_whose_ids_cannot_fit_in_host_memory_is_refused_naming_what_to_lower():
    """data.multi_hot=1000 at the defaults ran out of memory drawing the teacher's calibration sample, after the
    run had started writing its directory."""
    from loka_trainer.run_checks import check_host_memory

    with pytest.raises(ValueError) as err:
        check_host_memory(_memory_run(multi_hot=1000), device_type="cpu", local_ranks=1, available=16 * 2**30)
    assert str(err.value).startswith("host memory: this run needs at least 17.5 GiB but 16.0 GiB is available "
                                     "(1 rank(s) x 17.5 GiB for 212992000 ids generated at once: 8192 rows x "
                                     "data.num_sparse=26 x data.multi_hot=1000;"), str(err.value)
    assert str(err.value).endswith("lower data.multi_hot, data.num_sparse or data.teacher_latent_dim")
    check_host_memory(_memory_run(multi_hot=1000), device_type="cpu", local_ranks=1, available=None)
    check_host_memory(_memory_run(multi_hot=1), device_type="cpu", local_ranks=1, available=2**30)
    with pytest.raises(ValueError, match="or data.teacher_latent_dim$"):  # every rank on the host draws its own
        check_host_memory(_memory_run(multi_hot=20), device_type="cpu", local_ranks=8, available=2 * 2**30)
    check_host_memory(_memory_run(multi_hot=20), device_type="cpu", local_ranks=1, available=2 * 2**30)
    with pytest.raises(ValueError, match=", data.batch_size or"):  # batches larger than the calibration sample
        check_host_memory(_memory_run(batch_size=2**20), device_type="cuda", local_ranks=1, available=2 * 2**30)


def test_embedding_tables_count_in_host_memory_on_the_cpu_only():
    from loka_trainer.run_checks import check_host_memory

    run = _memory_run(num_sequences=2, sequence_vocab_size=2**31 - 1)
    with pytest.raises(ValueError, match="embedding tables in host memory: 256.1 GiB.*lower data.max_vocab_size"):
        check_host_memory(run, device_type="cpu", local_ranks=1, available=64 * 2**30)
    check_host_memory(run, device_type="cuda", local_ranks=1, available=64 * 2**30)


def test_the_host_memory_bound_is_below_what_the_synthetic_source_takes():
    """The bound refuses only runs that clearly cannot fit: the source's measured peak stays above it."""
    import subprocess
    import sys

    from loka_trainer.data.config import DataConfig
    from loka_trainer.run_checks import host_bytes_per_id, ids_at_once

    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent (a large pytest worker) across exec
    code = ("import re; from loka_trainer.data.config import DataConfig; "
            "from loka_trainer.data.synthetic import SyntheticSource; "
            "peak = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024; "
            "before = peak(); "
            "SyntheticSource(DataConfig(multi_hot=20, teacher_latent_dim=4)).batch_at('train', 0); "
            "print(peak() - before)")
    taken = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               timeout=120).stdout.split()[-1])
    data = DataConfig(multi_hot=20, teacher_latent_dim=4)
    assert ids_at_once(data)[1] * host_bytes_per_id(data) < taken


def test_available_host_memory_is_meminfo_capped_by_the_cgroup_limit(tmp_path):
    from loka_trainer.run_checks import available_host_memory

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (cgroup / "memory").mkdir(parents=True)
    assert available_host_memory(proc, cgroup) is None
    (proc / "meminfo").write_text("MemTotal:  8000000 kB\nMemAvailable:  4000000 kB\n")
    assert available_host_memory(proc, cgroup) == 4_096_000_000
    (cgroup / "memory.max").write_text("max\n")
    assert available_host_memory(proc, cgroup) == 4_096_000_000
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("2000000000\n")
    assert available_host_memory(proc, cgroup) == 2_000_000_000
