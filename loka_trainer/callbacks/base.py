"""Callback interface: the events the trainer emits and the read-only state each event receives.

Where each event fires in the loop (see ``loka_trainer.trainer.Trainer.fit``)::

    on_train_start
    for step in range(start_step, steps):
        on_step_start            # state.step = index of the step about to run (0-based)
        loss = model(batch)      # forward
        on_after_forward         # state.loss is set
        loss.backward()
        on_after_backward
        optimizer.step()
        on_step_end              # state.step still the finished step; state.metrics holds train metrics
        [every eval_interval: on_eval_start -> evaluate -> on_eval_end]
        [every checkpoint interval: save -> on_checkpoint_save]
    on_train_end
    (any exception inside the loop -> on_exception, then re-raised)

A callback only observes. Anything that rewrites the model (Mods, FP8 Dispatch) is a model transform applied
before training, so reading ``build_*`` in the trainer is enough to know the model.

Plain user loops drive callbacks directly (no trainer needed)::

    state = TrainState(model=model)
    cb.on_train_start(state)
    for step, batch in enumerate(loader):
        state.step = step
        cb.on_step_start(state)
        loss = ...; loss.backward(); opt.step()
        cb.on_step_end(state)
    cb.on_train_end(state)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

EVENTS = (
    "on_train_start",
    "on_step_start",
    "on_after_forward",
    "on_after_backward",
    "on_step_end",
    "on_eval_start",
    "on_eval_end",
    "on_checkpoint_save",
    "on_checkpoint_load",
    "on_train_end",
    "on_exception",
)


def process_group_rank_and_size() -> tuple[int, int]:
    """(this process's rank, the world size) of torch.distributed's default group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclasses.dataclass
class TrainState:
    """What callbacks see. The trainer owns and updates it; callbacks must not mutate it.

    Fields a plain loop needs to set: ``model`` and ``step``. Everything else has a usable default: ``rank`` and
    ``world_size`` are torch.distributed's when a process group is up (a DDP loop's Probe then merges and writes its
    statistics from rank 0 alone), else 0 and 1.
    """

    model: nn.Module
    step: int = 0
    optimizers: Sequence[torch.optim.Optimizer] = ()
    loss: Optional[torch.Tensor] = None
    batch_size: int = 0  # local examples per step on this rank
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    rank: int = dataclasses.field(default_factory=lambda: process_group_rank_and_size()[0])
    world_size: int = dataclasses.field(default_factory=lambda: process_group_rank_and_size()[1])
    run_dir: Optional[Path] = None
    total_steps: Optional[int] = None
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    checkpoint_dir: Optional[Path] = None  # set for on_checkpoint_save / on_checkpoint_load
    skipped_steps: int = 0  # steps skipped for a non-finite loss so far (trainer.nonfinite=skip_step)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # run totals for summary.json (all ranks)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


class Callback:
    """Base class: every event is a no-op. Override the ones you need; the hook name is the event name.

    Callbacks that keep state across a checkpoint override ``state_dict`` / ``load_state_dict``; the trainer
    stores the result under ``callbacks/<state_key>`` in the checkpoint.
    """

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def on_train_start(self, state: TrainState) -> None: ...
    def on_step_start(self, state: TrainState) -> None: ...
    def on_after_forward(self, state: TrainState) -> None: ...
    def on_after_backward(self, state: TrainState) -> None: ...
    def on_step_end(self, state: TrainState) -> None: ...
    def on_eval_start(self, state: TrainState) -> None: ...
    def on_eval_end(self, state: TrainState) -> None: ...
    def on_checkpoint_save(self, state: TrainState) -> None: ...
    def on_checkpoint_load(self, state: TrainState) -> None: ...
    def on_train_end(self, state: TrainState) -> None: ...
    def on_exception(self, state: TrainState, exc: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class CallbackList:
    """Fans one event out to many callbacks, naming each call so it shows in a profiler trace."""

    def __init__(self, callbacks: Sequence[Callback]):
        self.callbacks = list(callbacks)

    def fire(self, event: str, state: TrainState, *args: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown callback event {event!r}; valid events: {', '.join(EVENTS)}")
        for cb in self.callbacks:
            with torch.profiler.record_function(f"callback/{type(cb).__name__}/{event}"):
                getattr(cb, event)(state, *args)
