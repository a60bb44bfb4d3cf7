"""A torch.profiler trace of a step range, written where TensorBoard's PyTorch Profiler tab finds it, and where
each profiled step's time went.

torch-tb-profiler lists every folder under TensorBoard's logdir holding ``*.pt.trace.json`` as a run, so the
trace goes to ``<run_dir>/tensorboard/profiler/`` (run name "profiler"). Each profiled step's host time and GPU
kernel time by kind (``profiling.trace_split``) go to ``summary_path`` (JSON) and to the log, one line per step.
On CUDA each profiled step ends with a synchronize, so that its kernels are in the trace and its host time spans
them. Rank 0 only.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

import torch

from loka_trainer.atomic_files import atomic_write_text
from loka_trainer.callbacks.base import Callback, TrainState
from loka_trainer.profiling.trace_split import split_steps, summary_line

log = logging.getLogger(__name__)


class ProfilerCallback(Callback):
    """Profiles steps [start_step, start_step + num_steps) of this run (CPU, and CUDA when present)."""

    def __init__(self, trace_dir: Path, *, start_step: int, num_steps: int, summary_path: Optional[Path] = None):
        self.trace_dir = Path(trace_dir)
        self.summary_path = None if summary_path is None else Path(summary_path)
        self.start_step = start_step
        self.num_steps = num_steps
        self.profiler: Optional[torch.profiler.profile] = None
        self._first_step = 0  # the training step at which the profiler started (its step N counts from there)

    def on_train_start(self, state: TrainState) -> None:
        """Starts the profiler for the window's steps from ``state.step`` on: a run resumed inside the window
        profiles the rest of it, one resumed past it profiles nothing (and keeps the earlier ``profile.json``)."""
        if not state.is_rank_zero:
            return
        first, end = max(self.start_step, state.step), self.start_step + self.num_steps
        if first >= end:
            log.info(f"profiler: steps {self.start_step}..{end - 1} lie before this run's first step {state.step} "
                     f"(resumed); nothing profiled")
            return
        self._first_step = state.step
        warmup = 1 if first - state.step >= 1 else 0
        wait = max(first - state.step - warmup, 0)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=end - first, repeat=1),
            on_trace_ready=self._write_trace,
            record_shapes=True,
        )
        self.profiler.start()

    def on_step_end(self, state: TrainState) -> None:
        if self.profiler is None:
            return
        if torch.cuda.is_available() and self.start_step <= state.step < self.start_step + self.num_steps:
            torch.cuda.synchronize()
        self.profiler.step()

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        """The trace, named as TensorBoard's handler names it, then its per-step split."""
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        try:
            steps = split_steps(json.loads(path.read_text()), step_offset=self._first_step)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the trace stays; only its summary is lost
            log.warning(f"profile summary skipped: {path} could not be read ({type(exc).__name__}: {exc})")
            return
        for step in steps:
            log.info(summary_line(step))
        if self.summary_path is not None:
            atomic_write_text(self.summary_path, json.dumps({"trace": str(path), "steps": steps}, indent=1))

    def on_train_end(self, state: TrainState) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        self.on_train_end(state)
