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
