"""scripts/quality_runs.py: precision variants, arguments, its table and curves (scripts/plot_results) and whole
calls on CPU. Its run queue: tests/test_run_queue.py."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import plot_results
from scripts import quality_runs as qr
from scripts.provenance import source_digest
from scripts.run_queue import SUMMARY_KEYS
from scripts.plot_results import (mean_curve, plot_quality, plot_quality_curves, quality_table, summarize,
                                  trajectory_rll)

ROOT = Path(__file__).resolve().parents[1]


# ---- precision variants -----------------------------------------------------------------------------------------
def test_variants_map_to_their_overrides_and_presets_to_precision_equals():
    assert qr.precision_overrides("bf16_mods") == ["precision=loka", "precision.dispatch=false"]
    assert qr.precision_overrides("fp8_rowwise") == ["precision=fp8_rowwise"]
    assert {"bf16_mods", "bf16", "loka", "fp8_tensorwise"} <= set(qr.known_variants())


def test_torchao_auto_variant_keeps_wukongs_token_mixes_in_bf16():
    """fp8_tensorwise_auto: torchao's size filter leaves the small token-mix Linears (K = n_in tokens) alone, which
    uniform FP8 converts (and so moves off their batched GEMM, models.layers.TokenMix)."""
    from torchao.float8.float8_linear import Float8Linear

    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.data import data_schema
    from loka_trainer.models.zoo import build_model
    from loka_trainer.precision import apply_precision

    register_schemas()
    converted = {}
    for variant in ("fp8_tensorwise", "fp8_tensorwise_auto"):
        run = to_run_config(compose_config("config", ["model=wukong", *qr.precision_overrides(variant),
                                                      "model.num_fm_embeddings=16", "model.num_lc_embeddings=16",
                                                      "precision.min_features=16", "data.max_vocab_size=16"])[0])
        model = build_model(run.model, schema=data_schema(run.data), loka_mods=run.precision.mods)
        apply_precision(model, config=run.precision, device="cpu", log=lambda _: None)
        converted[variant] = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert "layers.1.lcb.linear" in converted["fp8_tensorwise"]
    assert not any("lcb" in n or "projection" in n for n in converted["fp8_tensorwise_auto"])
    assert converted["fp8_tensorwise_auto"] < converted["fp8_tensorwise"]


def _wukong_run(variant: str):
    """The typed run config of ``model=wukong`` under a precision variant (tiny vocab: builds fast)."""
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config

    register_schemas()
    return to_run_config(compose_config("config", ["model=wukong", *qr.precision_overrides(variant),
                                                   "data.max_vocab_size=16"])[0])


def _built(run):
    from loka_trainer.data import data_schema
    from loka_trainer.models.zoo import build_model

    return build_model(run.model, schema=data_schema(run.data), loka_mods=run.precision.mods)


def test_bf16_mods_builds_the_mods_model_and_converts_nothing_to_fp8():
    import torch

    from loka_trainer.kernels.linear import LoKALinear
    from loka_trainer.mods.layers import BlockNorm, HardSwish
    from loka_trainer.precision import apply_precision

    run = _wukong_run("bf16_mods")
    assert (run.precision.mods, run.precision.dispatch, run.precision.fp8_recipe) == (True, False, None)
    assert run.precision.compute_dtype == "bfloat16"
    model = _built(run)
    linears_before = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert apply_precision(model, config=run.precision, device="cpu", log=lambda _: None) is None
    kinds = {type(m) for m in model.modules()}
    assert BlockNorm in kinds and HardSwish in kinds and LoKALinear not in kinds
    assert [n for n, m in model.named_modules() if type(m) is torch.nn.Linear] == linears_before  # no Float8Linear


@pytest.mark.parametrize("variant,kept", [
    ("bf16_mods_bias", {"bias"}), ("bf16_mods_layernorm", {"norm"}), ("bf16_mods_silu", {"activation"}),
])
def test_mods_ablation_variants_undo_exactly_one_mod(variant, kept):
    import torch

    from loka_trainer.mods.layers import BlockNorm, HardSwish

    run = _wukong_run(variant)
    assert (run.precision.mods, run.precision.dispatch) == (True, False)
    modules = list(_built(run).modules())
    kinds = {type(m) for m in modules}
    published = {"bias": all(m.bias is not None for m in modules if isinstance(m, torch.nn.Linear)),
                 "norm": torch.nn.LayerNorm in kinds and BlockNorm not in kinds,
                 "activation": torch.nn.SiLU in kinds and HardSwish not in kinds}
    assert {k for k, v in published.items() if v} == kept


def test_loka_published_dispatches_on_the_published_layers():
    run = _wukong_run("loka_published")
    assert (run.precision.mods, run.precision.dispatch, run.precision.name) == (False, True, "loka")


@pytest.mark.parametrize("argv,message", [
    (["--precisions", "bf16", "turbo"], "unknown 'turbo'"),
    (["--precisions", "loka"], "must include bf16"),
    (["--precisions", "bf16", "--nproc", "2", "--launcher", "python"], "--launcher python runs one process"),
    (["--precisions", "bf16", "--concurrent", "0"], "--concurrent"),
    (["--precisions", "bf16", "--gpus", "-1"], "--gpus >= 0"),
    (["--precisions", "bf16", "--gpus", "3", "--nproc", "2"], "--gpus 3 is not a multiple of --nproc 2"),
    (["--precisions", "bf16", "--reuse-from", "docs"], "--reuse-from docs: not a study folder"),
    (["--precisions", "bf16", "loka", "--seeds", "0", "1", "0"], "--seeds: 0 given more than once"),
    (["--precisions", "bf16", "bf16"], "--precisions: bf16 given more than once"),
])
def test_bad_arguments_fail_in_one_line_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        qr.parse_args(["--out", "unused", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_launcher_follows_nproc_unless_given():
    assert qr.parse_args(["--out", "x", "--nproc", "1"]).launcher == "python"
    assert qr.parse_args(["--out", "x"]).launcher == "torchrun"
    assert qr.parse_args(["--out", "x", "--nproc", "1", "--launcher", "torchrun"]).launcher == "torchrun"


# ---- table and curves ---------------------------------------------------------------------------------------------
def _run(precision: str, seed: int, logloss: float, curve=None) -> dict:
    run = {"model": "wukong", "precision": precision, "seed": seed, "train": [[10, 0.6], [20, 0.55]],
           "eval": {"eval_logloss": logloss, "eval_ne": 0.9, "eval_auc": 0.7}, "examples_per_s": 1.0}
    if curve is not None:
        run["eval_curve"] = curve
    return run


def test_table_pairs_seeds_reports_loka_vs_bf16_mods_and_the_seeds_of_each_cell():
    runs = [_run("bf16", 0, 0.50), _run("bf16", 1, 0.51), _run("bf16_mods", 0, 0.505), _run("bf16_mods", 1, 0.51),
            _run("loka", 0, 0.505), _run("loka", 1, 0.5151), _run("loka", 2, 0.6)]  # seed 2: no baseline yet
    rows = {r["precision"]: r for r in summarize({"runs": runs})}
    loka = rows["loka"]
    assert loka["seeds"] == 3 and loka["rll_seeds"] == 2 and loka["rll_vs_mods_seeds"] == 2
    assert loka["rll_pct_mean"] == pytest.approx((1.0 + 1.0) / 2)
    assert loka["rll_vs_mods_pct_mean"] == pytest.approx((0.0 + 1.0) / 2)
    assert rows["bf16"]["noise_floor_seeds"] == 2 and "mods_baseline" not in rows["bf16_mods"]
    table = quality_table({"runs": runs})
    assert "| wukong | loka | 3 | +1.000 ± 0.000 (n=2) |" in table and "| +0.500 ± 0.500 (n=2) |" in table


def test_table_of_a_partial_result_without_bf16_or_with_one_seed_says_n_a():
    table = quality_table({"runs": [_run("loka", 0, 0.5), _run("bf16_mods", 0, 0.5)]})
    assert "| wukong | loka | 1 | n/a | n/a | +0.000 (n=1) |" in table
    one = quality_table({"runs": [_run("bf16", 0, 0.5)]})
    assert "| wukong | bf16 | 1 | +0.000 (n=1) | n/a |" in one


def test_a_null_metric_makes_its_statistics_null_instead_of_crashing_the_study(tmp_path):
    """summary.json writes a non-finite metric as null (NE or AUC over one class; examples/s when a run logged no
    step): each statistic over that run is null in the table, the other cells and the plots are still made (it was
    a TypeError raised after the run finished, which stopped every other run of the study)."""
    runs = [_run(p, s, 0.5 + 0.01 * s) for p in ("bf16", "loka") for s in (0, 1)]
    runs[3]["eval"]["eval_auc"] = None
    runs[3]["examples_per_s"] = None
    runs[1]["eval"]["eval_logloss"] = None  # bf16 seed 1: its RLL pairs and the noise floor cannot be computed
    rows = {r["precision"]: r for r in summarize({"runs": runs})}
    assert rows["loka"]["eval_ne"] == pytest.approx(0.9) and math.isnan(rows["loka"]["eval_auc"])
    assert math.isnan(rows["loka"]["examples_per_s"]) and math.isnan(rows["bf16"]["noise_floor_pct"])
    table = quality_table({"runs": runs})
    assert "| wukong | loka | 2 | null (n=2) | null (n=2) |  | 0.9000 | null |" in table
    assert plot_quality({"runs": runs}, tmp_path) == tmp_path / "quality_rll.png"


def test_train_loss_windows_pair_the_same_steps_when_a_run_logged_fewer(tmp_path):
    """A log window all skipped (non-finite loss: no ``loss`` in that record) in the run or in its BF16 baseline:
    each window compares the losses of the steps both runs logged and ends at the same step for every seed (it
    paired the i-th records, so every later window compared different batches, and the seeds' windows ended at
    different steps); a run without train records draws no curve."""
    base = {"train": [[s, 1.0 / s] for s in range(10, 110, 10)]}
    run = {"train": [[s, 1.01 / s] for s in range(10, 110, 10) if s != 30]}
    rows = trajectory_rll(run, base)
    assert [x for x, _ in rows] == [50, 100] and [y for _, y in rows] == pytest.approx([1.0, 1.0])
    gap = {"train": [r for r in base["train"] if r[0] != 30]}
    rows = trajectory_rll({"train": [[s, 1.02 / s] for s in range(10, 110, 10)]}, gap)
    assert [x for x, _ in rows] == [50, 100] and [y for _, y in rows] == pytest.approx([2.0, 2.0])
    assert trajectory_rll({"train": []}, base) == [] and trajectory_rll(run, {"train": []}) == []
    runs = [{**_run("bf16", 0, 0.5), **base}, {**_run("loka", 0, 0.5), **run},
            {**_run("bf16", 1, 0.5), **gap}, {**_run("loka", 1, 0.5), **base}]
    assert plot_quality({"runs": runs}, tmp_path) == tmp_path / "quality_rll.png"


def test_mean_curve_averages_the_steps_every_seed_has():
    steps, mean = mean_curve([[[10, 1.0], [20, 2.0], [30, 3.0]], [[10, 3.0], [20, 4.0]]])
    assert steps == [10, 20] and mean == [2.0, 3.0]


def test_curve_plot_needs_eval_points_and_older_results_draw_none(tmp_path):
    assert plot_quality_curves({"runs": [_run("bf16", 0, 0.5)]}, tmp_path) is None
    runs = [_run(p, s, 0.5, curve=[[10, 0.6], [20, 0.55], [30, 0.5]]) for p in ("bf16", "loka") for s in (0, 1)]
    path = plot_quality_curves({"runs": runs}, tmp_path)
    assert path == tmp_path / "quality_curve.png" and path.stat().st_size > 0


def test_a_run_that_stopped_early_draws_its_curve_so_far_dashed_and_stays_out_of_the_table(tmp_path):
    jobs = [qr.Job("wukong", p, 0, tmp_path / "runs" / f"wukong_{p}_seed0", []) for p in ("bf16", "fp8_tensorwise")]
    evals = [json.dumps({"step": step, "eval_logloss": loss}) for step, loss in ((10, 0.6), (20, 0.5), (30, 0.45))]
    for job in jobs:
        job.run_dir.mkdir(parents=True)
    (jobs[0].run_dir / "metrics.jsonl").write_text("\n".join(evals) + "\n")
    (jobs[0].run_dir / "summary.json").write_text(json.dumps(dict.fromkeys(SUMMARY_KEYS, 0.5)))
    stopped = [*evals[:2], json.dumps({"step": 25, "loss": 0.4}), '{"step": 3']  # killed while writing a line
    (jobs[1].run_dir / "metrics.jsonl").write_text("\n".join(stopped))
    assert qr.unfinished_run(jobs[1]) == {"model": "wukong", "precision": "fp8_tensorwise", "seed": 0,
                                          "last_step": 25, "eval_curve": [[10, 0.6], [20, 0.5]]}  # cut line skipped
    result, plots = qr.write_results(tmp_path, {}, jobs, [])
    assert [r["precision"] for r in result["runs"]] == ["bf16"] and len(result["unfinished"]) == 1
    assert [row["precision"] for row in summarize(result)] == ["bf16"]  # not in the table
    lines = plot_results.eval_curve_lines(result)["wukong"]
    assert [(p, kind, label) for p, kind, _, label in lines] == [
        ("bf16", "seed", None), ("bf16", "mean", "bf16 (n=1)"),
        ("fp8_tensorwise", "unfinished", "fp8_tensorwise seed 0, stopped at step 25")]
    assert tmp_path / "quality_curve.png" in plots
    one_point = {**result, "unfinished": [{**result["unfinished"][0], "eval_curve": [[10, 0.6]]}]}
    assert [kind for _, kind, _, _ in plot_results.eval_curve_lines(one_point)["wukong"]] == ["seed", "mean"]
    (jobs[1].run_dir / "metrics.jsonl").write_text('{"step": 5, "loss": 0.6}\n')
    assert qr.unfinished_run(jobs[1]) is None  # no evaluation logged: nothing to draw


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT) for p in (ROOT / "docs" / "results").rglob("quality.json")
                                        if "runs" not in p.parts))
def test_every_published_quality_json_still_makes_a_table(path):
    result = json.loads((ROOT / path).read_text())
    table = quality_table(result).splitlines()
    assert len(table) == 2 + len({(r["model"], r["precision"]) for r in result["runs"]})


# ---- end to end on CPU ----------------------------------------------------------------------------------------------
TINY = ["trainer.device=cpu", "data.batch_size=64", "data.eval_batches=2", "data.max_vocab_size=1000",
        "trainer.log_interval=5", "callbacks.tensorboard=false", "data.prefetch=0"]


@pytest.mark.slow
def test_concurrent_runs_resume_and_a_budget_leaves_a_partial_table(tmp_path):
    base = [sys.executable, "-m", "scripts.quality_runs", "--out", str(tmp_path), "--models", "wukong",
            "--precisions", "bf16", "bf16_mods", "--steps", "10", "--eval-interval", "5", "--nproc", "1",
            "--concurrent", "2"]
    proc = subprocess.run([*base, "--seeds", "0", "--", *TINY], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    launches = [json.loads((tmp_path / "runs" / f"wukong_{p}_seed0.launch.json").read_text())
                for p in ("bf16", "bf16_mods")]
    assert all(rec["returncode"] == 0 for rec in launches) and launches[0]["port"] != launches[1]["port"]
    assert all(set(rec) >= {"commit", "dirty", "source"} for rec in launches)  # the checkout each run came from
    starts = [line for line in proc.stdout.splitlines() if line.startswith("started")]
    ends = [i for i, line in enumerate(proc.stdout.splitlines()) if line.startswith("finished")]
    assert len(starts) == 2 and proc.stdout.splitlines().index(starts[1]) < ends[0]  # both ran at once
    result = json.loads((tmp_path / "quality.json").read_text())
    assert [r["eval_curve"][0][0] for r in result["runs"]] == [5, 5] and len(result["runs"][0]["eval_curve"]) == 2
    assert [(r["device"], r["torch"]) for r in result["runs"]] == [("cpu", torch.__version__)] * 2
    assert all(r["finished"].endswith("+00:00") and r["commit"] == launches[0]["commit"] for r in result["runs"])
    assert {r["source"] for r in result["runs"]} == {source_digest()}
    # a second call: seed 0 is reused, seed 1 gets no start within a zero budget, the table stays usable
    proc = subprocess.run([*base, "--seeds", "0", "1", "--time-budget", "0", "--", *TINY], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 finished earlier (reused), 2 to run" in proc.stdout and "\nstarted " not in proc.stdout
    result = json.loads((tmp_path / "quality.json").read_text())
    assert len(result["runs"]) == 2 and [n["run"] for n in result["not_run"]] == ["wukong_bf16_seed1",
                                                                                   "wukong_bf16_mods_seed1"]
    assert "| wukong | bf16_mods | 1 |" in proc.stdout


def test_git_keeps_a_finished_runs_record_and_ignores_the_rest_of_its_directory():
    # a study spread over machines or sessions goes on from committed records: read_run's files are not ignored
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    run = "docs/results/any_study/runs/wukong_h200_loka_seed0"
    paths = [f"{run}/summary.json", f"{run}/metrics.jsonl", f"{run}.launch.json",
             f"{run}.log", f"{run}/train.log", f"{run}/tensorboard/events.out", f"{run}/checkpoint.pt"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=root, capture_output=True, text=True)
    assert out.stdout.split() == paths[3:]


class _OutOfMemoryOnce:
    """A launcher whose first start of ``oom`` ends in torch's out-of-memory error; every other start writes a
    finished run's records at its first poll."""

    def __init__(self, oom: str):
        self.oom, self.starts = oom, []

    def start(self, job):
        self.starts.append(job.name)
        failing = job.name == self.oom and self.starts.count(job.name) == 1
        job.run_dir.mkdir(parents=True, exist_ok=True)
        if failing:
            job.log_file.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
        else:
            (job.run_dir / "summary.json").write_text(json.dumps(dict.fromkeys(SUMMARY_KEYS, 0.5)))
            (job.run_dir / "metrics.jsonl").write_text('{"step": 5, "eval_logloss": 0.5}\n')
        return type("Proc", (), {"poll": lambda self: 1 if failing else 0, "terminate": lambda self: None})()

    def finish(self, job, code):
        pass


def test_a_run_out_of_gpu_memory_beside_others_trains_again_and_is_no_failure(tmp_path, monkeypatch, capsys):
    fake = _OutOfMemoryOnce(oom="wukong_bf16_seed0")
    monkeypatch.setattr(qr, "Launcher", lambda *args, **kwargs: fake)
    qr.main(["--out", str(tmp_path), "--models", "wukong", "--precisions", "bf16", "--seeds", "0", "1",
             "--steps", "10", "--concurrent", "2", "--", *TINY])  # exits 1 if any run failed
    assert fake.starts == ["wukong_bf16_seed0", "wukong_bf16_seed1", "wukong_bf16_seed0"]
    out = capsys.readouterr().out
    assert "wukong_bf16_seed0 ran out of device memory beside other runs: it starts again alone" in out
    result = json.loads((tmp_path / "quality.json").read_text())
    assert len(result["runs"]) == 2 and result["not_run"] == []
