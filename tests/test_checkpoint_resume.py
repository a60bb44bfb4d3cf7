"""Restarting train.py over damaged checkpoints: the newest complete one wins, nothing good is overwritten."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from tests.launch import ROOT, SMALL, run_train

COMMON = ["model=dlrm", "trainer.log_interval=1", "trainer.eval_interval=0", "trainer.checkpoint_interval=2",
          "callbacks.tensorboard=false", *SMALL]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def _contents(path: Path) -> dict[str, tuple[str, int]]:
    """Every file under `path` -> (SHA-256 of its bytes, mtime_ns)."""
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """1 rank, 8 steps planned, stopped after 6: checkpoints at steps 2, 4, 6; metrics for steps 1-6."""
    run_dir = tmp_path_factory.mktemp("resume") / "base"
    run_train([*COMMON, "trainer.steps=8", "trainer.stop_after=6", f"hydra.run.dir={run_dir}"])
    return run_dir


def _copy(stopped_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_run, run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("fault, reason", [
    (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    (lambda p: os.truncate(p / "__0_0.distcp", 1000), "__0_0.distcp has 1000 bytes"),
], ids=["metadata_removed", "distcp_truncated"])  # every other fault: tests/test_checkpoint_files.py
def test_restart_resumes_from_the_newest_complete_checkpoint(stopped_run, tmp_path, fault, reason):
    run_dir = _copy(stopped_run, tmp_path)
    ckpts = run_dir / "checkpoints"
    fault(ckpts / "step_000006")
    good = {name: _tree(ckpts / name) for name in ("step_000002", "step_000004")}
    proc = run_train([*COMMON, "trainer.steps=8", f"hydra.run.dir={run_dir}"])
    log = (run_dir / "train.log").read_text()
    [warning] = [line for line in log.splitlines() if "skipped checkpoint" in line]
    assert "step_000006" in warning and reason in warning
    assert f"resumed from {ckpts / 'step_000004'} at step 4" in log
    assert {name: _tree(ckpts / name) for name in good} == good  # read, never rewritten
    train_steps = [r["step"] for r in _records(run_dir) if "loss" in r]
    assert train_steps == list(range(1, 9))  # one series: 1-4 from the first run, 5-8 from this one
    assert (ckpts / "latest").read_text() == "step_000008"
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_no_complete_checkpoint_exits_2_with_one_line_and_writes_nothing(stopped_run, tmp_path):
    run_dir = _copy(stopped_run, tmp_path)
    for step in (2, 4, 6):
        (run_dir / "checkpoints" / f"step_{step:06d}" / "__0_0.distcp").unlink()
    before = _tree(run_dir)
    proc = run_train([*COMMON, "trainer.steps=8", "trainer.lr=0.01", f"hydra.run.dir={run_dir}"], check=False,
                     timeout=120)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: no complete checkpoint among the 3") and "trainer.resume=false" in line
    assert _tree(run_dir) == before  # .hydra/config.yaml, overrides.yaml, metrics.jsonl, train.log untouched


@pytest.mark.slow
def test_resume_false_starts_over_and_moves_the_earlier_run_aside(stopped_run, tmp_path):
    run_dir = _copy(stopped_run, tmp_path)
    before_ckpt, before_metrics = _tree(run_dir / "checkpoints"), (run_dir / "metrics.jsonl").read_bytes()
    run_train([*COMMON, "trainer.steps=4", "trainer.resume=false", f"hydra.run.dir={run_dir}"])
    [dest] = list((run_dir / "previous").iterdir())
    assert _tree(dest / "checkpoints") == before_ckpt
    assert (dest / "metrics.jsonl").read_bytes() == before_metrics
    assert "trainer.steps=8" in (dest / ".hydra" / "overrides.yaml").read_text()
    assert "trainer.steps=4" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert f"were moved to {dest}" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004"]


@pytest.mark.slow
@pytest.mark.parametrize("override, named", [
    ("model.mods.bias=false", 'model.mods.bias=null there, false here'),
    ("model.mods.activation=silu", 'model.mods.activation=null there, "silu" here'),  # no parameter changes
    ("precision=loka", "precision.mods=false there, true here"),
    ("model.over_arch_widths=[64,16]", "model.over_arch_widths=[64, 32] there, [64, 16] here"),
], ids=["mods_drop_biases", "other_activation", "loka_mods", "other_width"])
def test_a_checkpoint_of_another_model_is_refused_with_one_line_and_left_as_it_was(stopped_run, tmp_path, override,
                                                                                   named):
    run_dir = _copy(stopped_run, tmp_path)
    before = _tree(run_dir)
    proc = run_train([*COMMON, "trainer.steps=8", override, f"hydra.run.dir={run_dir}"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert "step_000006 was written for another model" in line and named in line, line
    assert "trainer.resume=false" in line
    assert _tree(run_dir) == before  # nothing read beyond the markers, nothing written


@pytest.mark.slow
@pytest.mark.parametrize("override, named", [
    ("data.outliers.spike_rate=0.01", "outliers.spike_rate=0.0 but this stream has outliers.spike_rate=0.01"),
    ("data.target_ctr=0.3", "target_ctr=0.25 but this stream has target_ctr=0.3"),
    ("data.batch_size=128", "batch_size=256 but this stream has batch_size=128"),
    ("data.seed=1", "seed=0 but this stream has seed=1"),
], ids=["outliers", "target_ctr", "batch_size", "seed"])
def test_a_checkpoint_of_other_synthetic_data_is_refused_and_left_as_it_was(stopped_run, tmp_path, override, named):
    """Refused from the rank file's saved data position before anything is built or written."""
    run_dir = _copy(stopped_run, tmp_path)
    before = _contents(run_dir)
    proc = run_train([*COMMON, "trainer.steps=8", override, f"hydra.run.dir={run_dir}"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "step_000006 does not fit this run" in line and named in line, line
    assert "trainer.resume=false" in line and line.count("resume with") == 1, line  # the advice once
    assert _contents(run_dir) == before  # train.log, metrics.jsonl, the checkpoints and config byte for byte


@pytest.mark.slow
def test_a_run_its_checkpoint_already_ends_does_nothing_and_one_past_its_steps_is_refused(stopped_run, tmp_path):
    """The stopped run (checkpoint at step 6 = trainer.stop_after) started again: nothing is written, exit 0; with
    trainer.steps=4 the checkpoint lies past the run's end: one line, exit 2 (it used to evaluate and record a
    step 7, overwriting summary.json)."""
    run_dir = _copy(stopped_run, tmp_path)
    before = _tree(run_dir)
    proc = run_train([*COMMON, "trainer.steps=8", "trainer.stop_after=6", f"hydra.run.dir={run_dir}"], timeout=120)
    assert proc.stdout.strip().splitlines()[-1].startswith(
        f"nothing to do: the checkpoint {run_dir / 'checkpoints' / 'step_000006'} is at step 6, trainer.stop_after=6")
    assert _tree(run_dir) == before
    proc = run_train([*COMMON, "trainer.steps=4", f"hydra.run.dir={run_dir}"], check=False, timeout=120)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "is at step 6, past trainer.steps=4: raise trainer.steps" in line
    assert _tree(run_dir) == before


class _Payload:
    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return os.mkdir, (self.target,)


@pytest.mark.slow
def test_crafted_rank_file_is_refused_with_one_line_not_executed(stopped_run, tmp_path):
    """Even with the marker rewritten to match it, a pickled object in rankN.pt never runs (weights_only)."""
    run_dir = _copy(stopped_run, tmp_path)
    newest, target = run_dir / "checkpoints" / "step_000006", tmp_path / "payload_ran"
    with (newest / "rank0.pt").open("wb") as f:
        pickle.dump({"rng": _Payload(str(target))}, f)
    if (newest / "complete.json").is_file():  # (a checkpoint written without markers is loaded as it is)
        marker = json.loads((newest / "complete.json").read_text())
        data = (newest / "rank0.pt").read_bytes()
        marker["files"]["rank0.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (newest / "complete.json").write_text(json.dumps(marker))
    before = {name: (run_dir / name).read_bytes() for name in (".hydra/config.yaml", ".hydra/overrides.yaml",
                                                               "metrics.jsonl")}
    proc = run_train([*COMMON, "trainer.steps=8", "trainer.lr=0.01", f"hydra.run.dir={run_dir}"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = _error_lines(proc.stderr)
    assert "rank0.pt" in line and "weights_only=True" in line and "trusted source" in line
    assert "Traceback" not in proc.stderr
    assert not target.exists()
    assert {name: (run_dir / name).read_bytes() for name in before} == before


@pytest.mark.slow
def test_two_ranks_resume_past_a_deleted_rank_file_step_for_step(tmp_path):
    """2 gloo ranks: rank1.pt of the newest checkpoint deleted; the rerun of steps 5-6 matches the first run's."""
    common, run_dir = [*COMMON, "trainer.steps=8"], tmp_path / "run"
    run_train([*common, "trainer.stop_after=6", f"hydra.run.dir={run_dir}"], nproc=2)
    first = {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}
    (run_dir / "checkpoints" / "step_000006" / "rank1.pt").unlink()
    run_train([*common, f"hydra.run.dir={run_dir}"], nproc=2)
    log = (run_dir / "train.log").read_text()
    assert "step_000006: rank1.pt is missing" in log and "at step 4" in log
    got = [(r["step"], r["loss"]) for r in _records(run_dir) if "loss" in r]
    assert [s for s, _ in got] == list(range(1, 9))
    for step, loss in got[:6]:
        assert loss == pytest.approx(first[step], rel=1e-6, abs=1e-7), step


def _another_models(text: str) -> str:
    plan = json.loads(text)
    return json.dumps({**plan, "layers": {"ghost.0": next(iter(plan["layers"].values()))}})


@pytest.mark.parametrize("damage, needle", [
    (lambda text: text[:100], "is not valid JSON"),
    (_another_models, "unknown layer 'ghost.0'"),
], ids=["truncated", "another_models"])
@pytest.mark.slow
def test_a_resumed_loka_run_whose_plan_is_damaged_stops_in_one_line_before_anything_starts(tmp_path, damage, needle):
    run_dir = tmp_path / "loka"
    loka = [*COMMON, "precision=loka", "precision.timing_rounds=1", "precision.min_speedup=0.001",
            "precision.min_features=16", "trainer.steps=4", f"hydra.run.dir={run_dir}"]
    run_train([*loka, "trainer.stop_after=2"])
    plan = run_dir / "dispatch_plan.json"
    plan.write_text(damage(plan.read_text()))
    before = _tree(run_dir)
    proc = run_train(loka, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = _error_lines(proc.stderr)
    assert line.startswith("error: precision.plan") and needle in line and "Traceback" not in proc.stderr
    assert _tree(run_dir) == before


@pytest.mark.slow
@pytest.mark.parametrize("shorter_summary", [False, True], ids=["no_summary", "shorter_runs_summary"])
def test_a_run_stopped_between_its_last_checkpoint_and_its_summary_finishes_on_restart(stopped_run, tmp_path,
                                                                                       shorter_summary):
    """A kill after the final checkpoint left no summary.json, or the summary.json of a shorter run this one
    continued (trainer.steps raised): the restart does not say "nothing to do" but resumes there, writes the
    summary of this step and no record twice."""
    run_dir = _copy(stopped_run, tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    if shorter_summary:
        (run_dir / "summary.json").write_text(json.dumps({**summary, "steps": 4}))
    else:
        (run_dir / "summary.json").unlink()
    records = _records(run_dir)
    proc = run_train([*COMMON, "trainer.steps=8", "trainer.stop_after=6", f"hydra.run.dir={run_dir}"], timeout=120)
    assert "nothing to do" not in proc.stdout
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["steps"] == summary["steps"] and _records(run_dir) == records


@pytest.mark.slow
def test_a_resume_with_other_probe_settings_stops_in_one_line(tmp_path):
    run_dir = tmp_path / "probe"
    probed = [*COMMON, "callbacks.probe.enabled=true", "callbacks.probe.interval=2", "trainer.steps=4",
              f"hydra.run.dir={run_dir}"]
    run_train([*probed, "trainer.stop_after=2"])
    before = _tree(run_dir)
    proc = run_train([*probed, "callbacks.probe.covariance_block=4", "callbacks.probe.max_full_covariance=4"],
                     check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert "does not fit this run" in line and "Probe statistics of layer" in line and "callbacks.probe" in line
    assert _tree(run_dir) == before  # train.log included: refused before anything is written


@pytest.mark.slow
def test_a_fresh_run_moves_an_earlier_runs_stats_in_its_probe_out_dir_aside(tmp_path):
    """Two runs pointing callbacks.probe.out_dir at one folder: the second's fresh start moves the first's stats.pt
    to <out_dir>/previous/ untouched; resuming the second leaves its own stats.pt where it is."""
    out = tmp_path / "shared_probe"
    probed = [*COMMON, "callbacks.probe.enabled=true", "callbacks.probe.interval=2", "trainer.steps=4",
              f"callbacks.probe.out_dir={out}"]
    run_train([*probed, f"hydra.run.dir={tmp_path / 'first'}"])
    first = (out / "stats.pt").read_bytes()
    second = tmp_path / "second"
    run_train([*probed, "trainer.stop_after=2", f"hydra.run.dir={second}"])
    [dest] = list((out / "previous").iterdir())
    assert (dest / "stats.pt").read_bytes() == first
    assert (out / "stats.pt").read_bytes() != first
    assert f"were moved to {dest}" in (second / "train.log").read_text()
    run_train([*probed, f"hydra.run.dir={second}"])
    assert [p.name for p in (out / "previous").iterdir()] == [dest.name]  # a resume moves nothing
    assert "resumed from" in (second / "train.log").read_text()


@pytest.mark.slow
def test_a_data_position_that_fits_rank_0_but_not_rank_1_stops_every_rank_with_one_line(tmp_path):
    """2 gloo ranks over a Criteo file that grew by a row after the checkpoint: rank 0's byte range is unchanged,
    rank 1's ends later. Rank 0 prints the one error line naming rank 1 and nothing is written."""
    from loka_trainer.data.config import DataConfig
    from loka_trainer.data.criteo import criteo_identity
    from tests.test_cli import criteo_lines

    data, run_dir = tmp_path / "day.txt", tmp_path / "run"
    data.write_text("".join(criteo_lines(1200)))
    args = ["data=criteo", f"data.path={data}", "data.prefetch=0", "data.eval_batches=0", "trainer.steps=4",
            "trainer.checkpoint_interval=2", "data.batch_size=64", "data.max_vocab_size=2000",
            "callbacks.progress=false", "callbacks.tensorboard=false", f"hydra.run.dir={run_dir}"]
    run_train([*args, "trainer.stop_after=2"], nproc=2)
    cfg = DataConfig(name="criteo", path=str(data), eval_batches=0, batch_size=64, max_vocab_size=2000)
    ranges = [criteo_identity(cfg, split="train", rank=r, world_size=2)["byte_range"] for r in range(2)]
    with data.open("a") as f:
        f.write(criteo_lines(1, seed=7)[0])
    grown = [criteo_identity(cfg, split="train", rank=r, world_size=2)["byte_range"] for r in range(2)]
    assert grown[0] == ranges[0] and grown[1] != ranges[1]  # the mismatch is rank 1's alone
    before = _contents(run_dir)
    proc = run_train(args, nproc=2, check=False, timeout=300)
    assert proc.returncode != 0  # torchrun's own status: 1 once a rank exits 2
    [line] = _error_lines(proc.stderr)
    assert "step_000002 does not fit this run (rank 1: " in line and f"byte_range={ranges[1]}" in line, line
    assert f'File "{ROOT / "train.py"}"' not in proc.stderr  # no rank's traceback (torchrun prints its own)
    assert "exitcode: 2" in proc.stderr  # the first rank torchrun saw end left with the check's status
    assert _contents(run_dir) == before


def _restore_worker(rank: int, out_dir: str) -> None:
    """Train 2 steps on 2 ranks, then restore that checkpoint into a trainer whose data seed differs on rank 1."""
    import torch

    from loka_trainer.checkpoint import CheckpointError
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.sharding.dist import DistInfo
    from loka_trainer.trainer import Trainer

    register_schemas()
    dist_info = DistInfo(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"), backend="gloo")

    def trainer(*overrides: str) -> Trainer:
        cfg = compose_config("config", [*COMMON, "trainer.steps=2", *overrides]).cfg
        return Trainer(to_run_config(cfg), run_dir=Path(out_dir), dist_info=dist_info)

    trainer().fit(0)
    resumed = trainer(f"data.seed={rank}")
    try:
        outcome = f"resumed at step {resumed.restore(Path(out_dir) / 'checkpoints' / 'step_000002')}"
    except CheckpointError as exc:
        outcome = str(exc)
    (Path(out_dir) / f"outcome{rank}.txt").write_text(outcome)


@pytest.mark.slow
def test_a_restore_that_fails_on_rank_1_only_raises_rank_1s_line_on_every_rank(tmp_path):
    """The load's own check of the data position, for what the check before start-up leaves to it: every rank
    raises the same line, so rank 0 (the one that prints) stops too instead of training on alone."""
    from tests.spawn import run_on_ranks

    run_on_ranks(_restore_worker, 2, str(tmp_path))
    outcomes = [(tmp_path / f"outcome{r}.txt").read_text() for r in range(2)]
    assert outcomes[0] == outcomes[1], outcomes
    assert "step_000002 does not fit this run (rank 1: ValueError: " in outcomes[0] and "seed=0" in outcomes[0]


@pytest.mark.slow
def test_a_resume_under_another_precision_is_named_in_one_line_and_trains_on(stopped_run, tmp_path):
    """The fp32 run's checkpoint continued under torchao's FP8 (2 Linears converted): it holds no state of its
    precision, so the switch is the user's to make, named once in train.log; one metrics series."""
    run_dir = _copy(stopped_run, tmp_path)
    run_train([*COMMON, "trainer.steps=8", "precision=fp8_tensorwise", "precision.min_features=16",
               f"hydra.run.dir={run_dir}"])
    log = (run_dir / "train.log").read_text()
    [line] = [x for x in log.splitlines() if "under another precision" in x]
    assert (f"resuming from {run_dir / 'checkpoints' / 'step_000006'} under another precision than it was trained "
            f"with: precision=fp32 (float32) there, precision=fp8_tensorwise (torchao float8 tensorwise) here") in line
    assert "torchao float8 'tensorwise' on 2 Linear(s)" in log
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == list(range(1, 9))
    marker = json.loads((run_dir / "checkpoints" / "step_000008" / "complete.json").read_text())
    assert marker["precision"]["name"] == "fp8_tensorwise"


@pytest.mark.slow
def test_a_checkpoint_trained_without_dispatch_resumed_under_loka_measures_its_plan(tmp_path):
    """BF16 + Mods (precision=loka precision.dispatch=false) continued as LoKA: no plan to keep to, so Dispatch
    measures one and writes it."""
    run_dir = tmp_path / "run"
    loka = [*COMMON, "precision=loka", "trainer.steps=4", f"hydra.run.dir={run_dir}"]
    run_train([*loka, "precision.dispatch=false", "trainer.stop_after=2"])
    run_train([*loka, "precision.timing_rounds=1", "precision.min_speedup=0.001", "precision.min_features=16"])
    log = (run_dir / "train.log").read_text()
    assert "precision=loka (bfloat16 autocast with the Mods) there, precision=loka (LoKA Dispatch) here" in log
    assert (f"trained without Dispatch: Dispatch measures this run's plan now and writes it to "
            f"{run_dir / 'dispatch_plan.json'}") in log
    assert (run_dir / "dispatch_plan.json").is_file()
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == [1, 2, 3, 4]
