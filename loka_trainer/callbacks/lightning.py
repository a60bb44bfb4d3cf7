"""Run any loka_trainer `Callback` (the LoKA Probe included) inside a PyTorch Lightning trainer.

    from loka_trainer.callbacks.lightning import LightningAdapter
    trainer = pl.Trainer(callbacks=[LightningAdapter(ProbeCallback(interval=100), run_dir="runs/x")])

Event mapping (Lightning hook -> loka event): on_train_start -> on_train_start; on_train_batch_start ->
on_step_start; on_before_backward -> on_after_forward (``state.loss``: the loss Lightning backpropagates, divided by
k under accumulation); on_after_backward -> on_after_backward; on_train_batch_end -> on_step_end (with
``state.loss`` from the step's output); on_validation_start -> on_eval_start (also between the batches of an
accumulated step, where Lightning may validate); on_validation_end -> on_eval_end (``state.eval_metrics`` from
``trainer.callback_metrics``); on_save_checkpoint / on_load_checkpoint -> the callback's state_dict is stored in /
restored from Lightning's checkpoint under ``loka_callbacks/<state_key>``; on_train_end and on_exception as named.
``state.step`` is Lightning's ``global_step`` (optimizer steps taken before this batch). Under
``accumulate_grad_batches=k`` one step is k batches: on_step_start fires at the first of them, on_after_forward and
on_after_backward once per batch (the Probe folds each batch's layer inputs before its backward, so it holds one
batch's at a time), and on_step_end after the one whose optimizer step ran, as in the loka trainer; on_train_end gets
the last step trained.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch

from loka_trainer.callbacks.base import Callback, TrainState

CHECKPOINT_KEY = "loka_callbacks"


def stepped(open_step: Optional[int], global_step: int) -> bool:
    """Whether the batch that just ended ran the optimizer step opened at ``open_step`` (Lightning's
    ``global_step`` then; it counts optimizer steps), so the loka step ends here."""
    return open_step is not None and global_step > open_step


class LightningAdapter(pl.Callback):
    def __init__(self, callback: Callback, *, run_dir: Optional[str | Path] = None):
        self.callback = callback
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.state: Optional[TrainState] = None
        self._open_step: Optional[int] = None  # global_step when the step in flight fired on_step_start

    def _state(self, trainer: pl.Trainer, module: pl.LightningModule) -> TrainState:
        if self.state is None:
            run_dir = self.run_dir or Path(trainer.default_root_dir)
            self.state = TrainState(model=module, rank=trainer.global_rank, world_size=trainer.world_size,
                                    run_dir=run_dir, total_steps=trainer.max_steps if trainer.max_steps > 0 else None,
                                    device=module.device)
        self.state.optimizers = tuple(trainer.optimizers)
        self.state.step = trainer.global_step
        return self.state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._open_step = None
        self.callback.on_train_start(self._state(trainer, pl_module))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        state = self._state(trainer, pl_module)
        if self._open_step is not None:  # a later batch of an accumulated step: the step started already
            return
        self._open_step = trainer.global_step
        state.metrics = {}
        self.callback.on_step_start(state)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        state = self._state(trainer, pl_module)
        state.loss = loss.detach()
        self.callback.on_after_forward(state)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.callback.on_after_backward(self._state(trainer, pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        state = self._state(trainer, pl_module)
        if not stepped(self._open_step, trainer.global_step):  # gradients accumulate: the step goes on
            return
        self._open_step = None
        state.step = trainer.global_step - 1  # the step that just finished, as in the loka trainer
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        state.loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        self.callback.on_step_end(state)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.callback.on_eval_start(self._state(trainer, pl_module))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self._state(trainer, pl_module)
        state.eval_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.callback.on_eval_end(state)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint.setdefault(CHECKPOINT_KEY, {})[self.callback.state_key] = self.callback.state_dict()
        self.callback.on_checkpoint_save(self._state(trainer, pl_module))

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY, {})
        if self.callback.state_key in saved:
            self.callback.load_state_dict(saved[self.callback.state_key])
        self.callback.on_checkpoint_load(self._state(trainer, pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self._state(trainer, pl_module)
        state.step = trainer.global_step - 1  # the last step trained, as in the loka trainer
        self.callback.on_train_end(state)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.callback.on_exception(self._state(trainer, pl_module), exception)
