"""callbacks.profiler on a resumed run: only the steps of its window that the run still trains are profiled."""
from __future__ import annotations

import json

import torch
from torch import nn

from loka_trainer.callbacks.base import TrainState
from loka_trainer.callbacks.profiler import ProfilerCallback


def _train(tmp_path, *, first: int, last: int, start_step: int, num_steps: int) -> ProfilerCallback:
    """A plain loop over steps [first, last] with the callback, as the trainer calls it."""
    callback = ProfilerCallback(tmp_path / "traces", start_step=start_step, num_steps=num_steps,
                                summary_path=tmp_path / "profile.json")
    model = nn.Linear(4, 4)
    state = TrainState(model=model, step=first)
    callback.on_train_start(state)
    for step in range(first, last + 1):
        state.step = step
        model(torch.randn(2, 4)).sum().backward()
        callback.on_step_end(state)
    callback.on_train_end(state)
    return callback


def test_a_run_resumed_inside_the_window_profiles_the_rest_of_it(tmp_path):
    _train(tmp_path, first=3, last=7, start_step=2, num_steps=3)
    assert [s["step"] for s in json.loads((tmp_path / "profile.json").read_text())["steps"]] == [3, 4]


def test_a_run_resumed_past_the_window_profiles_nothing_and_keeps_the_summary(tmp_path):
    (tmp_path / "profile.json").write_text('{"steps": [{"step": 1}, {"step": 2}]}')
    _train(tmp_path, first=4, last=7, start_step=1, num_steps=2)
    assert json.loads((tmp_path / "profile.json").read_text())["steps"] == [{"step": 1}, {"step": 2}]
    assert not (tmp_path / "traces").exists()


def test_a_fresh_run_profiles_its_window(tmp_path):
    _train(tmp_path, first=0, last=5, start_step=2, num_steps=2)
    assert [s["step"] for s in json.loads((tmp_path / "profile.json").read_text())["steps"]] == [2, 3]
