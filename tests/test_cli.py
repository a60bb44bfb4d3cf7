"""train.py's command line: Hydra's own flags, one-line failures before anything starts, edge configs, counts."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from loka_trainer.config import TrainerConfig
from tests.launch import run_train

TINY = ["trainer.steps=2", "data.batch_size=64", "data.max_vocab_size=2000", "data.eval_batches=2",
        "callbacks.progress=false", "callbacks.tensorboard=false"]


def _one_error_line(proc, *needles: str) -> str:
    """The single stderr line of a run that must have failed with exit status 2 (no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def criteo_lines(num_rows: int, *, seed: int = 0) -> list[str]:
    """``num_rows`` valid Criteo TSV lines: label, 13 counts, 26 8-digit hex categoricals."""
    rng = random.Random(seed)
    return ["\t".join([str(rng.randint(0, 1)), *(str(rng.randint(0, 50)) for _ in range(13)),
                       *(f"{rng.getrandbits(32):08x}" for _ in range(26))]) + "\n" for _ in range(num_rows)]


# ---- Hydra's own command line ------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_groups_and_options_but_no_schema(flag):
    proc = run_train([flag], check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listing = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    groups = {line.split(":")[0]: line.split(":", 1)[1] for line in listing.splitlines() if ": " in line}
    assert set(groups) == {"model", "data", "precision", "sharding"}, proc.stdout
    assert "wukong" in groups["model"] and "loka" in groups["precision"] and "criteo" in groups["data"]
    assert "--multirun" in proc.stdout and "--cfg" in proc.stdout
    assert "_schema" not in proc.stdout


def test_cfg_job_prints_the_composed_config_and_runs_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(["--cfg", "job", "model=wukong", "trainer.steps=7", f"hydra.run.dir={run_dir}"], check=False,
                     timeout=120)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["model"]["name"] == "wukong" and cfg["trainer"]["steps"] == 7 and "hydra" not in cfg
    assert not run_dir.exists()


def test_config_dir_adds_options_to_the_groups(tmp_path):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "narrow.yaml").write_text(
        "defaults:\n  - /dlrm_schema@_here_\n  - _self_\nname: dlrm\nembedding_dim: 8\ndense_arch_widths: [32, 8]\n")
    proc = run_train(["--config-dir", str(tmp_path / "conf"), "--cfg", "job", "model=narrow"], check=False,
                     timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["model"]["dense_arch_widths"] == [32, 8]


@pytest.mark.parametrize("args, needles", [
    (["+trainer.nonexistent=1"], ["unknown key trainer.nonexistent", "TrainerConfig"]),
    (["+callbacks.profiler.every=3"], ["unknown key callbacks.profiler.every"]),
    (["+unknown_top_level=1"], ["unknown key unknown_top_level"]),
    (["-m", "trainer.steps=2", "+trainer.nonexistent=1,2"], ["unknown key trainer.nonexistent"]),
    (["trainer.nonexistent=1"], ["trainer.nonexistent"]),
    (["model=dlrm_schema"], ["Could not find 'model/dlrm_schema'"]),
    (["model=no_such_model"], ["Available options in 'model'", "wukong"]),
    (["precision=bf16,loka"], ["--multirun"]),
    (["-m", "precision=bf16,no_such_precision"], ["Could not find 'precision/no_such_precision'"]),
    (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (["-cn", "bench"], ["--config-name bench is the config of python -m loka_trainer.bench, not of train.py"]),
    (["callbacks.probe.enabled=true", "callbacks.probe.include=[over_arch.mlpp.*]"],
     ["callbacks.probe: include=['over_arch.mlpp.*']", "select none of the model's", "closest: ['over_arch.mlp.0'"]),
    (["--cfg", "job", "-m", "precision=bf16,fp32"], ["only one of --run, --multirun", "got --multirun, --cfg"]),
    (["-m", "precision=bf16,fp32", "trainer.checkpoint_dir=shared_ck"],
     ["trainer.checkpoint_dir=shared_ck is shared by the sweep points precision=bf16 and precision=fp32"]),
    (["model.mods.block_size=0"], ["model.mods.block_size must be a positive int, got 0"]),
    (["model.mods.block_size=-8", "precision=loka"], ["model.mods.block_size must be a positive int, got -8"]),
    (["model=dlrm_dcnv2", "model.name=dlrm"], ["model.name='dlrm' does not pick the model", "model=dlrm"]),
    (["precision=fp32", "precision.name=loka"], ["precision.name='loka' does not pick the precision",
                                                 "precision.name must stay 'fp32'", "precision=loka"]),
    (["-m", "sharding=auto,column_wise", "sharding.name=table_wise"],
     ["sharding.name='table_wise' does not pick the sharding", "under sharding=auto", "sharding=table_wise"]),
    (["precision=loka", "precision.min_speedup=inf"], ["precision.min_speedup: must be a finite number > 0, got inf"]),
    (["precision=loka", "precision.max_flushed_fraction=1.5"],
     ["precision.max_flushed_fraction: must be within [0, 1] (1 turns the check off), got 1.5"]),
    (["model=wukong", "precision=loka", "precision.exclude=[over_arch.mlpp.*]"],
     ["precision.exclude: ['over_arch.mlpp.*'] name(s) no FP8 target of this model", "over_arch.mlp.0"]),
    (["model=wukong", "precision=fp8_rowwise", "precision.exclude=[nope]"], ["precision.exclude: ['nope']"]),
    pytest.param(["precision=loka", "precision.backends=[fbgemm_rowwise]", "trainer.device=cpu"],
                 ["precision.backends: ['fbgemm_rowwise'] not available on cpu here; available: ['bf16'"],
                 id="backend_not_on_this_device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fbgemm's FP8 GEMMs may run on a GPU")),
    pytest.param(["trainer.device=cuda"], ["trainer.device=cuda but no CUDA device is available"], id="no_gpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
    (["model=wukong", "model.num_layers=0"], ["model.num_layers must be >= 1, got 0"]),
    (["model=interformer", "model.num_heads=3"], ["must be divisible by model.num_heads=3"]),
    (["sharding.embedding=row_wise", "trainer.device=cpu"],
     ["sharding.embedding=row_wise is not offered by TorchRec for embedding tables on cpu", "trainer.device=cuda"]),
    (["trainer.steps=10", "callbacks.profiler.enabled=true", "callbacks.profiler.start_step=9"],
     ["callbacks.profiler: steps 9..11 are not all inside the run (steps 0..9, trainer.steps=10)"]),
    (["trainer.lr=nan"], ["trainer.lr must be a finite number > 0, got nan"]),
    (["sharding=column_wise", "model.embedding_dim=6", "model.dense_arch_widths=[64,6]"],
     ["model.embedding_dim=6 must be a multiple of 4"]),
    (["model=interformer", "model.num_heads=0"], ["model.num_heads must be >= 1, got 0"]),
    (["data.drift=nan"], ["data.drift must be a finite number, got nan"]),
])
def test_bad_command_line_is_one_line_exit_2_before_anything_starts(tmp_path, args, needles):
    run_dir = tmp_path / "run"
    line = _one_error_line(run_train([*args, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={run_dir}"],
                                     check=False, timeout=120), *needles)
    if "Available options" in line:
        assert "_schema" not in line.split("Available options")[1]  # options offered never include a schema
    assert not run_dir.exists()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("changes, message", [
    ({"lr": NAN}, "trainer.lr must be a finite number > 0, got nan"),
    ({"lr": INF}, "trainer.lr must be a finite number > 0, got inf"),
    ({"embedding_lr": NAN}, "trainer.embedding_lr must be a finite number > 0, got nan"),
    ({"embedding_lr": 0.0}, "trainer.embedding_lr must be a finite number > 0, got 0.0"),
    ({"weight_decay": -1.0}, "trainer.weight_decay must be a finite number >= 0, got -1.0"),
    ({"weight_decay": NAN}, "trainer.weight_decay must be a finite number >= 0, got nan"),
    ({"weight_decay": INF}, "trainer.weight_decay must be a finite number >= 0, got inf"),
    ({"grad_clip_norm": NAN}, "trainer.grad_clip_norm must be a number >= 0 (0: no clipping, inf: only log the "
                              "norm), got nan"),
    ({"grad_clip_norm": -1.0}, "trainer.grad_clip_norm must be a number >= 0"),
    ({"warmup_steps": -1}, "trainer.warmup_steps must be >= 0, got -1"),
    ({"seed": 2**64}, "trainer.seed must be in [-2**63, 2**64) (torch.manual_seed's range), got 18446744073709551616"),
    ({"seed": -2**63 - 1}, "trainer.seed must be in [-2**63, 2**64)"),
])
def test_trainer_numbers_out_of_range_are_one_line_naming_the_field(changes, message):
    with pytest.raises(ValueError) as err:
        TrainerConfig(**changes).validate()
    assert str(err.value).startswith(message), str(err.value)


def test_every_seed_torch_takes_is_accepted():
    import torch
    for seed in (-2**63, -1, 0, 2**64 - 1):
        TrainerConfig(seed=seed).validate()
        torch.manual_seed(seed)


def test_every_float_trainer_field_refuses_nan_and_inf_only_logs_the_gradient_norm():
    floats = [f.name for f in dataclasses.fields(TrainerConfig) if f.type == "float"]
    assert len(floats) == 4
    for field in floats:
        with pytest.raises(ValueError, match=f"trainer.{field} must be"):
            TrainerConfig(**{field: NAN}).validate()
    TrainerConfig(grad_clip_norm=INF).validate()
    TrainerConfig(grad_clip_norm=0.0, weight_decay=0.0).validate()


def test_row_wise_embedding_sharding_is_offered_on_gpus_only():
    from loka_trainer.sharding.parallelize import embedding_sharding_types

    assert "row_wise" not in embedding_sharding_types("cpu") and "table_wise" in embedding_sharding_types("cpu")
    assert embedding_sharding_types("cuda") == ["auto", "table_wise", "column_wise", "row_wise"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_multirun_runs_each_point_in_its_own_dir(tmp_path, nproc):
    """On 2 ranks each point starts a process group in the same processes (a second one used to hang)."""
    sweep = tmp_path / "sweep"
    proc = run_train(["-m", "precision=fp32,bf16", *TINY, f"hydra.sweep.dir={sweep}"], nproc=nproc, check=False,
                     timeout=240)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2)]
    assert [s["precision"] for s in summaries] == ["fp32", "bf16"]
    assert all(s["steps"] == 2 for s in summaries)
    assert yaml.safe_load((sweep / "1" / ".hydra" / "overrides.yaml").read_text())[0] == "precision=bf16"


# ---- plan files (precision.plan) ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, workers", [
    ([], 1),
    (["model=interformer_h200"], 4),  # the preset sets data fields: composed after the data group
    (["model=interformer_h200", "data.workers=1"], 1),  # the command line still wins
])
def test_a_model_preset_sets_data_workers_and_the_command_line_overrides_it(overrides, workers):
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config

    register_schemas()
    composed = compose_config("config", overrides)
    run = to_run_config(composed.cfg, composed.choices)
    assert run.data.workers == workers


def _target_shapes(overrides: list[str]) -> dict[str, tuple[int, int]]:
    """FQN -> (K, N) of the Dispatch targets of the model the overrides compose."""
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.data import data_schema
    from loka_trainer.dispatch.targets import target_linears
    from loka_trainer.models.zoo import build_model

    register_schemas()
    run = to_run_config(compose_config("config", overrides)[0])
    model = build_model(run.model, schema=data_schema(run.data), loka_mods=run.precision.mods)
    linears = target_linears(model, min_features=run.precision.min_features)
    return {fqn: (m.in_features, m.out_features) for fqn, m in linears.items()}


def _bf16_plan(shapes: dict[str, tuple[int, int]]) -> str:
    return json.dumps({"version": 1, "device": "cpu", "layers": {
        fqn: {"shape": {"M": 64, "K": k, "N": n}, **{g: {"backend": "bf16"} for g in
                                                      ("forward", "input_grad", "weight_grad")}}
        for fqn, (k, n) in shapes.items()}})


@pytest.fixture(scope="module")
def plans_of_other_models() -> dict[str, str]:
    """Plans (JSON text) that match a model other than `model=dlrm_dcnv2`'s default."""
    return {"wukong": _bf16_plan(_target_shapes(["model=wukong", "precision=loka"])),
            "wider dlrm_dcnv2": _bf16_plan(_target_shapes(["model=dlrm_dcnv2", "precision=loka",
                                                           "model.over_arch_widths=[128,32]"]))}


def _fails_before_any_process_group(tmp_path, plan: Path, needles: list[str]) -> None:
    run_dir = tmp_path / "run"
    _one_error_line(run_train(["model=dlrm_dcnv2", "precision=loka", f"precision.plan={plan}",
                               f"hydra.run.dir={run_dir}"], check=False, timeout=120), "precision.plan", *needles)
    assert not run_dir.exists()


@pytest.mark.parametrize("content, needles", [
    (b"{not json", ["is not valid JSON"]),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", ["is not UTF-8 text"]),
    (b"[]", ["must be a JSON object", "got list"]),
    (b'{"version": 1, "layers": {"over_arch.mlp.0": {"shape": [432, 64]}}}', ["needs a 'shape' object"]),
    (b'{"version": 2, "layers": {}}', ["version must be 1"]),
])
def test_plan_file_of_the_wrong_kind_fails_in_one_line(tmp_path, content, needles):
    plan = tmp_path / "plan.json"
    plan.write_bytes(content)
    _fails_before_any_process_group(tmp_path, plan, needles)


@pytest.mark.parametrize("other, needles", [
    ("wukong", ["unknown layer", "not a target of this model"]),
    ("wider dlrm_dcnv2", ["has shape K=", "but the model's is"]),
])
def test_plan_of_another_model_fails_in_one_line(tmp_path, other, needles, plans_of_other_models):
    plan = tmp_path / "plan.json"
    plan.write_text(plans_of_other_models[other])
    _fails_before_any_process_group(tmp_path, plan, needles)


# ---- edge configs ------------------------------------------------------------------------------------------
def test_criteo_eval_slice_smaller_than_a_batch_fails_naming_the_sizes(tmp_path):
    data = tmp_path / "train.txt"
    data.write_text("".join(criteo_lines(2000)))
    run_dir = tmp_path / "run"
    _one_error_line(run_train(["data=criteo", f"data.path={data}", f"hydra.run.dir={run_dir}"], check=False,
                              timeout=120),
                    "eval slice", "data.eval_fraction=0.1", "fewer than one batch of data.batch_size=512")
    assert not run_dir.exists()



@pytest.mark.parametrize("data, needle", [("criteo", "Criteo TSV has no sequence columns"),
                                          ("synthetic", "leave it unset")])
def test_a_sequence_model_on_data_without_sequences_fails_naming_them(tmp_path, data, needle):
    path = tmp_path / "train.txt"
    path.write_text("".join(criteo_lines(3000)))
    args = ([f"data.path={path}", "data.batch_size=64"] if data == "criteo" else ["data.num_sequences=0"])
    run_dir = tmp_path / "run"
    _one_error_line(run_train(["model=interformer", f"data={data}", *args, f"hydra.run.dir={run_dir}"],
                              check=False, timeout=120),
                    "model=interformer reads behaviour sequences (model.num_sequences=2)",
                    f"data={data} provides none", needle)
    assert not run_dir.exists()

@pytest.mark.slow
def test_relative_paths_name_files_from_where_the_command_started_under_hydra_job_chdir(tmp_path):
    (tmp_path / "train.txt").write_text("".join(criteo_lines(3000)))
    proc = run_train([*TINY, "data=criteo", "data.path=train.txt", "data.batch_size=64", "data.eval_batches=2",
                      "hydra.run.dir=run", "hydra.job.chdir=true"], check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] > 0


@pytest.mark.slow
def test_no_eval_batches_trains_skips_evaluation_and_saves(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train([*TINY, "data.eval_batches=0", f"hydra.run.dir={run_dir}"], check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    log = (run_dir / "train.log").read_text()
    assert log.count("evaluation skipped: data.eval_batches=0") == 1 and "eval @" not in log
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000002"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval_auc" not in summary


# ---- counts ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_malformed_rows_are_totalled_over_ranks_and_splits(tmp_path):
    lines = criteo_lines(3000)
    bad = ["2" + lines[0][1:], "not\ta\tcriteo\tline\n", lines[1].replace("\t", "\tx", 1)]
    # the last 20% of the bytes (from about row 2400) is eval, each part split in halves over the 2 ranks:
    # 2 bad rows early in rank 0's train shard, 1 late in rank 1's, 2 among the first eval rows of rank 0
    dirty = lines[:10] + bad[:2] + lines[10:2200] + bad[2:] + lines[2200:2450] + bad[:2] + lines[2450:]
    data = tmp_path / "dirty.txt"
    data.write_text("".join(dirty))
    run_dir = tmp_path / "run"
    run_train(["data=criteo", f"data.path={data}", "data.prefetch=0", "data.eval_fraction=0.2", *TINY,
               "trainer.steps=30", f"hydra.run.dir={run_dir}"], nproc=2)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["malformed_rows"] == 5
    assert "malformed data rows skipped: 5 (train 3, eval 2; all ranks)" in (run_dir / "train.log").read_text()



@pytest.mark.slow
def test_criteo_eval_shares_of_unequal_batch_counts_evaluate_the_smallest_on_every_rank(tmp_path):
    # the last 20% of the bytes is eval, split in halves: rank 0's ~270 rows make 4 batches of 64, while 28 long
    # malformed lines leave rank 1 ~130 rows, 2 batches; the sharded forward needs both ranks on every batch
    data = tmp_path / "uneven.txt"
    data.write_text("".join(criteo_lines(2600)) + ("1\t" + "x" * 1000 + "\n") * 28)
    run_dir = tmp_path / "run"
    run_train(["data=criteo", f"data.path={data}", "data.prefetch=0", "data.eval_fraction=0.2", *TINY,
               "data.eval_batches=5", f"hydra.run.dir={run_dir}"], nproc=2, timeout=300)
    log = (run_dir / "train.log").read_text()
    assert log.count("evaluation covers 2 batches per rank, not data.eval_batches=5") == 1
    assert "eval_auc" in json.loads((run_dir / "summary.json").read_text())

def test_a_glob_sweep_lists_the_config_groups_options_those_of_config_dir_too(tmp_path):
    from loka_trainer.cli import sweep_points
    assert sweep_points(["model=glob(dlrm_*paper)", "trainer.steps=1,2"]) == [
        ["model=dlrm_dcnv2_paper", "trainer.steps=1"], ["model=dlrm_dcnv2_paper", "trainer.steps=2"],
        ["model=dlrm_paper", "trainer.steps=1"], ["model=dlrm_paper", "trainer.steps=2"]]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "dlrm_mine_paper.yaml").write_text("defaults:\n  - dlrm\n")
    assert sweep_points(["model=glob(dlrm_*paper)"], str(tmp_path)) == [
        ["model=dlrm_dcnv2_paper"], ["model=dlrm_mine_paper"], ["model=dlrm_paper"]]


@pytest.mark.slow
def test_under_torchrun_a_bad_command_line_is_one_error_line_not_one_per_rank(tmp_path):
    proc = run_train(["+trainer.stepz=5", f"hydra.run.dir={tmp_path}/run"], nproc=2, check=False, timeout=120)
    assert proc.returncode != 0  # torchrun reports its ranks' exit status 2 and exits 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unknown key trainer.stepz" in errors[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_a_second_run_on_a_run_directory_in_use_is_one_line_and_writes_nothing(tmp_path):
    from loka_trainer.output_dirs import RunDirLock
    run_dir = tmp_path / "run"
    lock = RunDirLock(run_dir)  # the first run, still ending (a requeued job starts the same command)
    _one_error_line(run_train([*TINY, f"hydra.run.dir={run_dir}"], check=False, timeout=120),
                    f"{run_dir} is in use by another run")
    assert list(run_dir.iterdir()) == []
    del lock
    run_train([*TINY, f"hydra.run.dir={run_dir}"], timeout=120)
    assert (run_dir / "summary.json").is_file()
