"""Same seed + same Dispatch plan => bitwise-identical losses on CPU, fresh or resumed (2 gloo ranks, FP8 GEMMs)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loka_trainer.dispatch.plan import load_plan
from loka_trainer.dispatch.plan_table import num_fp8_gemms
from tests.launch import SMALL, run_train

COMMON = ["model=dlrm", "precision=loka", "trainer.steps=8", "trainer.log_interval=1", "trainer.eval_interval=0",
          "trainer.checkpoint_interval=2", "callbacks.tensorboard=false", "precision.timing_repeats=1",
          "precision.timing_rounds=1", "precision.min_features=16", *SMALL]
# On CPU no FP8 GEMM beats BF16: accept any speedup and any error, so the measured plan runs FP8 GEMMs of several
# backends (the fastest of each GEMM in this one measurement; timing noise picks among them).
FP8_PLAN = ["precision.min_speedup=0.01", "precision.mere_threshold=10",
            "precision.backends=[bf16,scaled_mm_tensorwise,scaled_mm_rowwise,torchao_tensorwise,torchao_rowwise]"]


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_same_seed_and_plan_give_bitwise_identical_losses_fresh_and_resumed(tmp_path):
    interrupted = tmp_path / "interrupted"
    run_train([*COMMON, *FP8_PLAN, "trainer.stop_after=6", f"hydra.run.dir={interrupted}"], nproc=2)
    plan_bytes = (interrupted / "dispatch_plan.json").read_bytes()
    plan_file = shutil.copy(interrupted / "dispatch_plan.json", tmp_path / "plan.json")
    assert num_fp8_gemms(load_plan(plan_file)) >= 3  # the claim is about FP8 numerics

    fresh = tmp_path / "fresh"  # another process, the plan loaded from its file
    run_train([*COMMON, f"precision.plan={plan_file}", f"hydra.run.dir={fresh}"], nproc=2)
    assert (fresh / "dispatch_plan.json").read_bytes() == plan_bytes
    fresh_losses = _losses(fresh)
    assert sorted(fresh_losses) == list(range(1, 9))

    run_train([*COMMON, *FP8_PLAN, f"hydra.run.dir={interrupted}"], nproc=2)  # the same command, resumed
    assert (interrupted / "dispatch_plan.json").read_bytes() == plan_bytes  # not re-timed, not rewritten
    log = (interrupted / "train.log").read_text()
    assert "resumed from" in log and "reuses the run's plan" in log
    # exactly, step for step: steps 1-6 of two processes (plan measured / loaded), 7-8 resumed from a checkpoint
    assert _losses(interrupted) == fresh_losses


@pytest.mark.slow
def test_resume_without_the_runs_plan_stops_with_one_line_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_train([*COMMON, "trainer.steps=4", "trainer.stop_after=2", f"hydra.run.dir={run_dir}"])
    (run_dir / "dispatch_plan.json").unlink()
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = run_train([*COMMON, "trainer.steps=4", f"hydra.run.dir={run_dir}"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "needs the run's Dispatch plan" in line and "precision.plan=FILE" in line
    assert "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
