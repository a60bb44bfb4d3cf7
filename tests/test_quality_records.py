"""A quality study's finished run records: redrawn by --no-run, reused from another study, refused where they
were trained with other overrides or are damaged, never overwritten where they cannot be rebuilt."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scripts import quality_runs as qr
from scripts.run_queue import Job, job_differences, override_differences
from scripts.train_runs import unread_precision_fields

ROOT = Path(__file__).resolve().parents[1]


def test_no_run_rewrites_the_whole_table_from_committed_records_and_starts_nothing(tmp_path, monkeypatch):
    """After a call that ran a subset of the precisions (its quality.json: that subset), ``--no-run`` with the
    study's full command makes the table of every finished run again, listing the rest as not run."""
    published = ROOT / "docs" / "results" / "quality_h200"
    shutil.copytree(published / "runs", tmp_path / "runs")
    study = json.loads((published / "quality.json").read_text())
    argv = study["command"].split()[1:]
    argv[argv.index("--out") + 1] = str(tmp_path)
    plan = next(i for i, a in enumerate(argv) if a.startswith("precision.plan="))  # the machine's path: $PWD/...
    argv[plan] = f"precision.plan={ROOT}/docs/results/train_throughput_h200/loka_dispatch_plan.json"
    monkeypatch.setattr(qr.Launcher, "start", lambda *a: pytest.fail("--no-run started a run"))
    qr.main(["--no-run", *argv])
    result = json.loads((tmp_path / "quality.json").read_text())
    assert result["command"] == " ".join(["quality_runs.py", *argv])
    assert {(r["precision"], r["seed"]) for r in result["runs"]} == {(r["precision"], r["seed"]) for r in study["runs"]}
    assert [r["eval"] for r in result["runs"]] == [r["eval"] for r in study["runs"]]
    assert {e["why"] for e in result["not_run"]} <= {"not started: --no-run"}
    assert len(result["runs"]) + len(result["not_run"]) == len(argv[argv.index("--precisions") + 1:
                                                                     argv.index("--seeds")]) * 3


def test_a_table_whose_runs_have_no_records_is_not_rewritten(tmp_path, monkeypatch, capsys):
    """A study published before run records were kept (docs/results/quality_cpu): its command again, with or
    without --no-run, would write a table without its runs; it stops in one line and leaves the file alone."""
    published = ROOT / "docs" / "results" / "quality_cpu"
    shutil.copy(published / "quality.json", tmp_path / "quality.json")
    before = (tmp_path / "quality.json").read_bytes()
    argv = json.loads(before)["command"].split()[1:]
    argv[argv.index("--out") + 1] = str(tmp_path)
    monkeypatch.setattr(qr.Launcher, "start", lambda *a: pytest.fail("a run started"))
    for extra in (["--no-run"], []):
        with pytest.raises(SystemExit) as stop:
            qr.main([*extra, *argv])
        assert stop.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {tmp_path / 'quality.json'} holds ") and "no record under" in line, line
        assert (tmp_path / "quality.json").read_bytes() == before


# docs/results/quality_interformer_h200_warmup's command after its selection of runs: its flags and its overrides
WARMUP_FLAGS = ["--steps", "2400", "--eval-interval", "200", "--nproc", "1", "--share-plan"]
WARMUP_OVERRIDES = ["trainer.device=cuda", "trainer.compile=true", "data.batch_size=4096", "data.eval_batches=12",
                    "precision.timing_rounds=1", "trainer.warmup_steps=200", "trainer.grad_clip_norm=inf"]


def test_reuse_from_copies_the_baselines_so_only_the_changed_precision_would_train(tmp_path, monkeypatch):
    """A study of LoKA with one more override starts from the committed one: the BF16 and BF16 + Mods records are
    copied in unchanged, LoKA's are not, and a second call leaves what is there alone."""
    published = ROOT / "docs" / "results" / "quality_interformer_h200_warmup"
    argv = ["--out", str(tmp_path), "--models", "interformer_h200", "--precisions", "bf16", "bf16_mods", "loka",
            "--seeds", "1", "0", *WARMUP_FLAGS, "--reuse-from", str(published), "--no-run", "--", *WARMUP_OVERRIDES,
            "precision.exclude=[layers.*.seq_arch.personal_weight]"]
    monkeypatch.setattr(qr.Launcher, "start", lambda *a: pytest.fail("--no-run started a run"))
    qr.main(argv)
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == sorted(
        f"interformer_h200_{v}_seed{s}" for v in ("bf16", "bf16_mods") for s in (0, 1))
    for name in ("interformer_h200_bf16_seed1/metrics.jsonl", "interformer_h200_bf16_mods_seed0.launch.json"):
        assert (runs / name).read_bytes() == (published / "runs" / name).read_bytes()
    result = json.loads((tmp_path / "quality.json").read_text())
    assert {(r["precision"], r["seed"]) for r in result["runs"]} == {(v, s) for v in ("bf16", "bf16_mods")
                                                                      for s in (0, 1)}
    assert sorted(e["run"] for e in result["not_run"]) == ["interformer_h200_loka_seed0", "interformer_h200_loka_seed1"]
    summary = runs / "interformer_h200_bf16_seed1" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "edited here": True}))
    qr.main(argv)
    assert json.loads(summary.read_text())["edited here"]  # a run already in the study is not copied over


def test_a_damaged_record_is_named_not_counted_and_its_run_trains_again(tmp_path, monkeypatch, capsys):
    """A run whose summary.json or metrics.jsonl is damaged (a write cut short) is left out of the table with the
    reason and is among the runs to train; it was a JSONDecodeError traceback that stopped the whole study."""
    published = ROOT / "docs" / "results" / "quality_interformer_h200_warmup"
    shutil.copytree(published / "runs", tmp_path / "runs")
    (tmp_path / "runs" / "interformer_h200_loka_seed0" / "summary.json").write_text("{bad")
    with (tmp_path / "runs" / "interformer_h200_bf16_seed1" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')
    argv = ["--out", str(tmp_path), "--models", "interformer_h200", "--precisions", "bf16", "bf16_mods", "loka",
            "--seeds", "1", "0", *WARMUP_FLAGS, "--no-run", "--", *WARMUP_OVERRIDES]
    monkeypatch.setattr(qr.Launcher, "start", lambda *a: pytest.fail("--no-run started a run"))
    qr.main(argv)
    out = capsys.readouterr().out
    assert "interformer_h200_loka_seed0: not counted (summary.json is damaged" in out
    assert "interformer_h200_bf16_seed1: not counted (metrics.jsonl line 253 is damaged" in out
    result = json.loads((tmp_path / "quality.json").read_text())
    assert len(result["runs"]) == 4
    assert sorted(e["run"] for e in result["not_run"]) == ["interformer_h200_bf16_seed1", "interformer_h200_loka_seed0"]


# ---- finished runs trained with other overrides ---------------------------------------------------------------------
def test_override_differences_name_what_changes_the_training_and_nothing_else():
    recorded = ["model=wukong", "trainer.steps=300", "hydra.run.dir=a/runs/x", "callbacks.progress=false",
                "data.batch_size=64", "data.batch_size=128", "precision.exclude=[a]", "trainer.seed=0"]
    wanted = ["model=wukong", "trainer.steps=600", "hydra.run.dir=b/runs/x", "data.batch_size=128",
              f"+precision.plan={ROOT}/p.json", "trainer.seed=0"]  # the last of a key wins, as in Hydra
    assert override_differences(recorded, wanted) == [
        "precision.exclude=[a] (recorded, not in this command)", "precision.plan=p.json (not recorded)",
        "trainer.steps=600 (recorded trainer.steps=300)"]
    assert override_differences(recorded, wanted, unread={"precision.exclude", "precision.plan"}) == [
        "trainer.steps=600 (recorded trainer.steps=300)"]
    assert override_differences(["precision.plan=p.json"], [f"precision.plan={ROOT}/p.json"]) == []


def test_a_run_without_fp8_reads_no_fp8_setting_and_torchao_no_dispatch_setting():
    plain = unread_precision_fields(False, None, None)  # bf16, bf16_mods
    assert {"exclude", "timing_rounds", "plan", "min_features"} <= plain and not {"mods", "compute_dtype"} & plain
    torchao = unread_precision_fields(False, "tensorwise", None)
    assert {"timing_rounds", "plan"} <= torchao and not {"exclude", "min_features", "fp8_filter"} & torchao
    assert not {"timing_rounds", "exclude", "plan"} & unread_precision_fields(True, None, None)  # measures a plan
    loaded = unread_precision_fields(True, None, "plan.json")
    assert "timing_rounds" in loaded and not {"exclude", "plan"} & loaded


def test_a_loaded_shared_plan_is_no_difference_where_the_study_shares_one(tmp_path):
    run_dir = tmp_path / "runs" / "wukong_loka_seed1"
    run_dir.parent.mkdir()
    launch = run_dir.with_suffix(".launch.json")
    launch.write_text(json.dumps({"command": ["python", "train.py", "model=wukong", f"hydra.run.dir={run_dir}",
                                              "precision.plan=docs/results/other/plans/wukong_loka.json"]}))
    job = Job("wukong", "loka", 1, run_dir, ["model=wukong", "hydra.run.dir=elsewhere"])
    assert job_differences(job, run_dir) == [
        "precision.plan=docs/results/other/plans/wukong_loka.json (recorded, not in this command)"]
    job.shared_plan = tmp_path / "plans" / "wukong_loka.json"
    assert job_differences(job, run_dir) == []
    launch.write_text("{bad")
    assert job_differences(Job("wukong", "loka", 1, run_dir, ["model=x"]), run_dir) == []  # no command: not compared


def test_finished_runs_trained_with_other_overrides_stop_the_call_unless_accepted(tmp_path, monkeypatch, capsys):
    """The study's command with another override after `--` and another --steps: the finished runs were counted in
    one table with runs of the new settings, silently, and --no-run wrote the new command into quality.json. Now
    each such run is named with the overrides that differ and the call stops in one error line, exit 2, quality.json
    untouched; --accept-recorded counts them, each marked, and --no-run keeps the study's recorded command;
    --reuse-from copies no such run."""
    published = ROOT / "docs" / "results" / "quality_interformer_h200_warmup"
    shutil.copytree(published / "runs", tmp_path / "runs")
    shutil.copyfile(published / "quality.json", tmp_path / "quality.json")
    monkeypatch.setattr(qr.Launcher, "start", lambda *a: pytest.fail("--no-run started a run"))
    selection = ["--models", "interformer_h200", "--precisions", "bf16", "loka", "--seeds", "1", "0"]
    other = [*selection, *WARMUP_FLAGS, "--steps", "1200", "--no-run", "--", *WARMUP_OVERRIDES,
             "trainer.grad_clip_norm=1.0"]
    with pytest.raises(SystemExit) as exc:
        qr.main(["--out", str(tmp_path), *other])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and err.startswith("error: 4 finished run(s)") and err.count("\n") == 1
    named = [line for line in out.splitlines() if "trained with other overrides" in line]
    assert len(named) == 4 and all("trainer.grad_clip_norm=1.0 (recorded trainer.grad_clip_norm=inf); "
                                   "trainer.steps=1200 (recorded trainer.steps=2400)" in line for line in named)
    assert (tmp_path / "quality.json").read_bytes() == (published / "quality.json").read_bytes()

    qr.main(["--out", str(tmp_path), "--accept-recorded", *other])
    result = json.loads((tmp_path / "quality.json").read_text())
    assert len(result["runs"]) == 4 and all(len(r["differs_from_command"]) == 2 for r in result["runs"])
    assert result["command"] == json.loads((published / "quality.json").read_text())["command"]
    assert "--accept-recorded --models" in result["redrawn_by"] and "trainer.grad_clip_norm=1.0" in result["redrawn_by"]

    fresh = tmp_path / "fresh"
    qr.main(["--out", str(fresh), "--reuse-from", str(published), *other])
    assert not (fresh / "runs").exists() and "interformer_h200_bf16_seed0: not reused from" in capsys.readouterr().out
