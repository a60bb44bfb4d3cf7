"""TensorBoard after a resume: one series, as in metrics.jsonl (what an earlier run logged after the checkpoint is
hidden, not shown twice)."""
from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from loka_trainer.callbacks.base import TrainState
from loka_trainer.callbacks.logging import TensorBoardLogger

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _log(log_dir: Path, start: int, stop: int, value: float) -> None:
    """A run that starts after `start` done steps (0: fresh) and logs loss = value at steps start+1 .. stop."""
    state = TrainState(model=nn.Linear(1, 1))
    state.step = start
    logger = TensorBoardLogger(log_dir)
    logger.on_train_start(state)
    for step in range(start, stop):
        state.step, state.metrics = step, {"loss": value}
        logger.on_step_end(state)
    logger.on_train_end(state)


def test_a_resumed_run_hides_what_the_interrupted_one_logged_after_the_checkpoint(tmp_path):
    _log(tmp_path, 0, 6, value=1.0)   # interrupted after step 6; its checkpoint was at step 4
    _log(tmp_path, 4, 8, value=2.0)   # resumed from step 4
    acc = event_accumulator.EventAccumulator(str(tmp_path), purge_orphaned_data=True)
    acc.Reload()
    seen = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert seen == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 2.0), (6, 2.0), (7, 2.0), (8, 2.0)]


def test_a_run_resumed_at_its_last_step_shows_its_final_evaluation_once_and_keeps_the_train_scalars(tmp_path):
    """Stopped after its final evaluation but before summary.json: the resumed run evaluates the last step again."""
    steps, log_dir = 4, tmp_path / "tensorboard"
    state = TrainState(model=nn.Linear(1, 1), run_dir=tmp_path, total_steps=steps)
    logger = TensorBoardLogger(log_dir)
    logger.on_train_start(state)
    for step in range(steps):
        state.step, state.metrics = step, {"loss": 1.0}
        logger.on_step_end(state)
    state.eval_metrics = {"eval_auc": 0.6}
    logger.on_eval_end(state)
    logger.on_train_end(state)
    # what metrics.jsonl holds after the resume's trim: the train records, the final evaluation's dropped
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, steps + 1)))
    state = TrainState(model=nn.Linear(1, 1), step=steps, run_dir=tmp_path, total_steps=steps)
    logger = TensorBoardLogger(log_dir)
    logger.on_train_start(state)
    state.step, state.eval_metrics = steps - 1, {"eval_auc": 0.6}
    logger.on_eval_end(state)
    logger.on_train_end(state)
    acc = event_accumulator.EventAccumulator(str(log_dir), purge_orphaned_data=True)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/auc")] == [(steps, pytest.approx(0.6))]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, steps + 1))
