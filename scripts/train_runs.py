"""train.py runs for the benchmarks that measure the user's path: run one, read its logged throughput."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(run_dir: Path, overrides: list[str], nproc: int) -> list[dict]:
    """Run train.py once; returns its metrics.jsonl records (raises with the log's tail on failure)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), *overrides, "trainer.eval_interval=0", "trainer.checkpoint_at_end=false",
           "trainer.checkpoint_interval=0", "trainer.resume=false", "callbacks.progress=false",
           "data.eval_batches=1", f"hydra.run.dir={run_dir}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed ({proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steady_throughput(records: list[dict], warmup_steps: int) -> float:
    """Mean examples/s over logged train steps after the warm-up."""
    values = [r["examples_per_s"] for r in records if "examples_per_s" in r and r["step"] > warmup_steps]
    if not values:
        raise SystemExit(f"no logged step after --warmup-steps {warmup_steps}: train longer")
    return statistics.fmean(values)


def throughput_trajectory(records: list[dict]) -> list[list[float]]:
    """[[step, examples/s of the log window ending there], ...] of every logged train step."""
    return [[r["step"], r["examples_per_s"]] for r in records if "examples_per_s" in r]
