"""examples_per_s in metrics.jsonl counts training time only: an evaluation, a checkpoint save or a restore leaves the
steps of its log window counted with their own time, wherever it falls in the window. summary.json's mean covers the
whole run, also when it was resumed. data_wait_ms is the host time per step the loop waited for its next batch,
averaged over ranks."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from tests.launch import SMALL
from tests.spawn import run_on_ranks

WORLD = 2
BATCH = 256  # SMALL's data.batch_size, per rank
PAUSE_SECONDS = 100.0  # each evaluation, checkpoint save and checkpoint load
DATA_WAIT_SECONDS = (0.25, 0.5)  # per batch, rank 0 and rank 1: the loop waits that long for each train batch
# log windows of 4 steps; evaluations and saves fall inside them, not on their edges
SETTINGS = ["model=dlrm", *SMALL, "trainer.log_interval=4", "trainer.eval_interval=3", "trainer.checkpoint_interval=5",
            "callbacks.tensorboard=false"]


def _clock(step_seconds: float):
    """A callback that is also the trainer's clock: every step takes `step_seconds`, every pause PAUSE_SECONDS."""
    from loka_trainer.callbacks.base import Callback

    class Clock(Callback):
        now = 0.0

        def perf_counter(self) -> float:
            return self.now

        def on_step_start(self, state) -> None:
            self.now += step_seconds

        def on_eval_end(self, state) -> None:
            self.now += PAUSE_SECONDS

        def on_checkpoint_save(self, state) -> None:
            self.now += PAUSE_SECONDS

        def on_checkpoint_load(self, state) -> None:
            self.now += PAUSE_SECONDS

    return Clock()


def _waiting(batches, clock, seconds: float):
    """The train batches of `batches`, each taking `seconds` of `clock` to arrive."""
    for batch in batches:
        clock.now += seconds
        yield batch


def _worker(rank: int, out_dir: str) -> None:
    import torch

    import loka_trainer.trainer as trainer_module
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.sharding.dist import DistInfo

    register_schemas()
    dist_info = DistInfo(rank=rank, world_size=WORLD, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    checkpoint = None
    # steps 1-8, stopped there; then a resumed run, twice as slow per step, trains 9-12
    for overrides, step_seconds in ((["trainer.steps=12", "trainer.stop_after=8"], 1.0), (["trainer.steps=12"], 2.0)):
        cfg = compose_config("config", [*SETTINGS, *overrides]).cfg
        clock = _clock(step_seconds)
        trainer_module.time = types.SimpleNamespace(perf_counter=clock.perf_counter)
        trainer = trainer_module.Trainer(to_run_config(cfg), run_dir=Path(out_dir), dist_info=dist_info,
                                         extra_callbacks=[clock])
        start = trainer.restore(checkpoint) if checkpoint is not None else 0
        trainer.train_iter = _waiting(trainer.train_iter, clock, DATA_WAIT_SECONDS[rank])
        trainer.fit(start)
        checkpoint = trainer.state.checkpoint_dir


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """The run directory of `_worker`'s two runs (steps 1-8, then resumed for 9-12)."""
    run_dir = tmp_path_factory.mktemp("resumed_run")
    run_on_ranks(_worker, WORLD, str(run_dir))
    return run_dir


@pytest.mark.slow
def test_evaluations_checkpoints_and_a_restore_inside_a_log_window_do_not_count_as_training_time(resumed_run):
    records = [json.loads(line) for line in (resumed_run / "metrics.jsonl").read_text().splitlines()]
    throughput = {r["step"]: r["examples_per_s"] for r in records if "loss" in r}
    first, resumed = (WORLD * BATCH / (s + DATA_WAIT_SECONDS[0]) for s in (1.0, 2.0))  # rank 0's clock: its wait too
    assert throughput == pytest.approx({4: first, 8: first, 12: resumed})


@pytest.mark.slow
def test_each_window_logs_the_time_the_loop_waited_for_data_averaged_over_ranks(resumed_run):
    records = [json.loads(line) for line in (resumed_run / "metrics.jsonl").read_text().splitlines()]
    wait = {r["step"]: r["data_wait_ms"] for r in records if "loss" in r}
    mean_ms = 1000.0 * sum(DATA_WAIT_SECONDS) / WORLD
    assert wait == pytest.approx({4: mean_ms, 8: mean_ms, 12: mean_ms})


@pytest.mark.slow
def test_a_resumed_runs_summary_averages_the_throughput_of_every_logged_window(resumed_run):
    records = [json.loads(line) for line in (resumed_run / "metrics.jsonl").read_text().splitlines()]
    logged = [r["examples_per_s"] for r in records if "loss" in r]
    summary = json.loads((resumed_run / "summary.json").read_text())
    assert len(logged) == 3 and summary["examples_per_s"] == pytest.approx(sum(logged) / len(logged))
