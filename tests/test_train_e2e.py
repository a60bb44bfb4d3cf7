"""End to end through train.py: bad configs, 2-rank training, TensorBoard profiler trace, resume."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.launch import SMALL, run_train

pytestmark = pytest.mark.slow  # every test here runs train.py in a subprocess


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("override, message", [
    ("model=no_such_model", "Could not find 'model/no_such_model'"),
    ("data.batch_size=-3", "data.batch_size must be > 0"),
    ("data=criteo data.path=/does/not/exist.tsv", "data.path must be an existing Criteo TSV file"),
    ("trainer.no_such_key=1", "trainer.no_such_key"),
    ("trainer.steps=abc", "trainer.steps"),
    ("sharding.embedding=diagonal", "sharding.embedding='diagonal' is not one of"),
    ("trainer.warmup_steps=-1", "trainer.warmup_steps must be >= 0"),
])
def test_bad_config_fails_with_one_line_before_anything_starts(tmp_path, override, message):
    run_dir = tmp_path / "run"
    proc = run_train([*override.split(), f"hydra.run.dir={run_dir}"], check=False, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not run_dir.exists()  # nothing was created: no run dir, hence no process group, no data


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    proc = run_train(["model=dlrm", "trainer.steps=120", "trainer.eval_interval=60", "trainer.lr=3e-3",
                      "callbacks.profiler.enabled=true", "callbacks.profiler.start_step=3",
                      "callbacks.profiler.num_steps=2", f"hydra.run.dir={run_dir}", *SMALL], nproc=2)
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)
    return run_dir


def test_two_ranks_learn_the_planted_teacher(two_rank_run):
    summary = json.loads((two_rank_run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 120 and summary["model"] == "dlrm"
    assert summary["eval_auc"] > 0.6
    train = [r for r in _records(two_rank_run) if "loss" in r]
    assert [r["step"] for r in train] == list(range(10, 121, 10))
    assert sum(r["loss"] for r in train[-3:]) / 3 < train[0]["loss"]
    evals = [r for r in _records(two_rank_run) if "eval_auc" in r]
    assert [r["step"] for r in evals] == [60, 120]
    assert list((two_rank_run / "tensorboard").glob("events.out.tfevents.*"))
    assert (two_rank_run / "checkpoints" / "latest").read_text() == "step_000120"  # saved at the end
    log = (two_rank_run / "train.log").read_text()
    assert "falls back to fp16/fp16" in log and "FSDP2 units" in log and "embedding tables: 26 table_wise" in log
    assert "returned a view tensor" not in (two_rank_run.parent / "stderr.txt").read_text()  # no false FSDP2 alarm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_profiled_steps_are_summarized_in_the_run_dir_and_the_log(two_rank_run):
    """callbacks.profiler: steps 3 and 4 (0-based) profiled, each with its host time in profile.json and train.log."""
    profile = json.loads((two_rank_run / "profile.json").read_text())
    assert [s["step"] for s in profile["steps"]] == [3, 4]
    assert all(s["wall_ms"] > 0 and s["gpu_ms"] == 0 for s in profile["steps"])  # CPU run: no kernels
    for s in profile["steps"]:  # the trainer's phases, each inside the step
        assert {"data", "forward", "backward", "optimizer"} <= set(s["phases"])
        assert 0 < sum(p["host_ms"] for p in s["phases"].values()) <= s["wall_ms"]
    log = (two_rank_run / "train.log").read_text()
    assert "profile step 3: " in log and "profile step 4: " in log


def test_profiler_trace_is_listed_by_tensorboard_pytorch_profiler_plugin(two_rank_run):
    assert list((two_rank_run / "tensorboard" / "profiler").glob("*.pt.trace.json"))
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(two_rank_run / "tensorboard"),
                               "--port", str(port), "--host", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runs, deadline = None, time.time() + 90
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/runs",
                                            timeout=5) as r:
                    runs = json.loads(r.read())
                if runs and runs.get("runs"):
                    break
            except OSError:
                pass
            time.sleep(1)
        assert runs is not None and "profiler" in runs["runs"], runs
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_resume_continues_step_for_step(tmp_path):
    """With a warm-up past the resume point and clipping on (FSDP2 gradient shards on 2 ranks)."""
    common = ["model=dlrm", "trainer.steps=24", "trainer.log_interval=1", "trainer.eval_interval=0",
              "trainer.lr=0.002", "trainer.warmup_steps=16", "trainer.grad_clip_norm=0.01",
              "callbacks.tensorboard=false", *SMALL]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train([*common, f"hydra.run.dir={straight}"], nproc=2)
    run_train([*common, "trainer.stop_after=12", f"hydra.run.dir={resumed}"], nproc=2)  # stops right after a checkpoint
    assert (resumed / "checkpoints" / "latest").read_text() == "step_000012"
    assert json.loads((resumed / "summary.json").read_text())["steps"] == 12
    run_train([*common, f"hydra.run.dir={resumed}"], nproc=2)
    assert "resumed from" in (resumed / "train.log").read_text()
    want = {r["step"]: r["loss"] for r in _records(straight) if "loss" in r}
    got = {r["step"]: r["loss"] for r in _records(resumed) if "loss" in r}
    assert sorted(got) == list(range(1, 25))
    for step in range(13, 25):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), step
    records = {r["step"]: r for r in _records(resumed) if "loss" in r}
    assert [records[s]["lr"] for s in (1, 12, 13, 16, 24)] == pytest.approx([0.002 * f for f in (1 / 16, 12 / 16,
                                                                                                13 / 16, 1, 1)])
    assert all(r["grad_norm_max"] > 0.01 for r in records.values())  # the bound was hit: clipping ran every step


def test_loka_with_probe_on_two_ranks_writes_plan_and_statistics(tmp_path):
    """precision=loka (Mods + Dispatch, plan measured on rank 0 and broadcast) with the probe callback on."""
    run_dir = tmp_path / "loka"
    run_train(["model=wukong", "precision=loka", "trainer.steps=20", "trainer.eval_interval=0",
               "callbacks.probe.enabled=true", "callbacks.probe.interval=5", "callbacks.probe.save_interval=10",
               f"hydra.run.dir={run_dir}", *SMALL], nproc=2)
    plan = json.loads((run_dir / "dispatch_plan.json").read_text())
    assert plan["layers"] and all(set(lp) >= {"forward", "input_grad", "weight_grad"}
                                  for lp in plan["layers"].values())
    assert (run_dir / "probe" / "stats.pt").is_file()
    log = (run_dir / "train.log").read_text()
    assert "LoKA Dispatch plan" in log and "GEMMs in FP8" in log
    assert json.loads((run_dir / "summary.json").read_text())["precision"] == "loka"


def test_compiled_dense_units_train_like_eager(tmp_path):
    """trainer.compile=true under FSDP2 on 2 ranks: same data and seed, losses follow the eager run's."""
    losses = {}
    for compiled in (False, True):
        run_dir = tmp_path / f"compile_{compiled}"
        proc = run_train(["model=dlrm", "trainer.steps=20", "trainer.log_interval=5", "trainer.eval_interval=0",
                          f"trainer.compile={str(compiled).lower()}", f"hydra.run.dir={run_dir}", *SMALL], nproc=2)
        assert ("dense units compiled with torch.compile" in proc.stdout + proc.stderr) == compiled
        losses[compiled] = [r["loss"] for r in _records(run_dir) if "loss" in r]
    assert len(losses[True]) == len(losses[False]) >= 4
    for eager_loss, compiled_loss in zip(losses[False], losses[True]):
        assert abs(compiled_loss - eager_loss) <= 0.02 * eager_loss  # inductor reorders float math, no more


def test_the_training_batches_do_not_depend_on_whether_there_are_eval_batches(tmp_path):
    """The calibration sample comes from the train stream when there is no eval batch; it must not shift the data
    (it did by one batch: another step-1 loss)."""
    losses = {}
    for eval_batches in (0, 1):
        run_dir = tmp_path / f"eval{eval_batches}"
        run_train(["model=dlrm", "trainer.steps=2", "trainer.log_interval=1", "trainer.eval_interval=0",
                   "callbacks.tensorboard=false", "data.batch_size=64", "data.max_vocab_size=2000",
                   f"data.eval_batches={eval_batches}", f"hydra.run.dir={run_dir}"])
        losses[eval_batches] = [r["loss"] for r in _records(run_dir) if "loss" in r]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


@pytest.mark.parametrize("source", ["synthetic", "criteo"])
def test_data_worker_processes_train_on_the_same_batches_as_one_thread(tmp_path, source):
    """data.workers=3 (forked worker processes on each of 2 ranks; for a Criteo file each reads its rank's share and
    parses every third batch) against one background thread: same losses and eval."""
    from tests.test_cli import criteo_lines

    data = []
    if source == "criteo":
        (tmp_path / "day.txt").write_text("".join(criteo_lines(6000)))
        data = ["data=criteo", f"data.path={tmp_path / 'day.txt'}", "data.eval_batches=1"]
    records = {}
    for workers in (1, 3):
        run_dir = tmp_path / f"workers{workers}"
        run_train(["model=dlrm", "trainer.steps=6", "trainer.log_interval=1", "trainer.eval_interval=6",
                   "callbacks.tensorboard=false", f"data.workers={workers}", f"hydra.run.dir={run_dir}", *SMALL,
                   *data], nproc=2)
        records[workers] = _records(run_dir)
        assert "does not read" not in (run_dir / "train.log").read_text()  # data.workers is read, for a file too
    losses = {w: [r["loss"] for r in recs if "loss" in r] for w, recs in records.items()}
    evals = {w: [r["eval_auc"] for r in recs if "eval_auc" in r] for w, recs in records.items()}
    assert len(losses[1]) == 6 and losses[3] == losses[1]
    assert len(evals[1]) == 1 and evals[3] == evals[1]
