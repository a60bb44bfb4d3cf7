"""A torch.profiler trace of a step range, written where TensorBoard's PyTorch Profiler tab finds it.

torch-tb-profiler lists every folder under TensorBoard's logdir holding ``*.pt.trace.json`` as a run, so the
trace goes to ``<run_dir>/tensorboard/profiler/`` (run name "profiler"). Rank 0 only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from loka_trainer.callbacks.base import Callback, TrainState


class ProfilerCallback(Callback):
    """Profiles steps [start_step, start_step + num_steps) of this run (CPU, and CUDA when present)."""

    def __init__(self, trace_dir: Path, *, start_step: int, num_steps: int):
        self.trace_dir = Path(trace_dir)
        self.start_step = start_step
        self.num_steps = num_steps
        self.profiler: Optional[torch.profiler.profile] = None

    def on_train_start(self, state: TrainState) -> None:
        if not state.is_rank_zero:
            return
        warmup = 1 if self.start_step - state.step >= 1 else 0
        wait = max(self.start_step - state.step - warmup, 0)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=self.num_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.trace_dir)),
            record_shapes=True,
        )
        self.profiler.start()

    def on_step_end(self, state: TrainState) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self, state: TrainState) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        self.on_train_end(state)
