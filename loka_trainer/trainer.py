"""The training loop: data -> model -> loss -> backward -> step, with events to callbacks. No FP8 logic here.

Everything that changes the model (Mods, FP8 recipes, LoKA Dispatch) happens in `builders` before training.
Where a run starts is decided before the trainer exists (`loka_trainer.resume`); `restore` loads that
checkpoint and `fit` continues from the step it returns. A non-finite loss or gradient is handled by
`trainer.nonfinite` (`loka_trainer.nonfinite`).
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loka_trainer import checkpoint as ckpt
from loka_trainer.builders import (
    build_callbacks,
    build_dense_optimizer,
    build_parallel_model,
    build_streams,
)
from loka_trainer.callbacks.base import Callback, CallbackList, TrainState
from loka_trainer.config import RunConfig
from loka_trainer.run_checks import unread_sequences
from loka_trainer.data.base import peek
from loka_trainer.data.batch import Batch
from loka_trainer.dense_update import build_warmup, clip_gradients
from loka_trainer.metrics import CTRMetrics
from loka_trainer.nonfinite import NonFiniteError, NonFiniteGuard
from loka_trainer.precision import precision_identity
from loka_trainer.profiling.trace_split import phase_range
from loka_trainer.resume import checkpoint_root, model_identity
from loka_trainer.sharding.dist import DistInfo
from loka_trainer.stop_signal import RunStopped, StopSignals

logger = logging.getLogger("loka_trainer")
AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


class Trainer:
    def __init__(self, run: RunConfig, *, run_dir: Path, dist_info: DistInfo,
                 extra_callbacks: Optional[list[Callback]] = None, log: Optional[Callable[[str], None]] = None):
        self.run, self.run_dir, self.dist = run, Path(run_dir), dist_info
        self.log = log or (logger.info if dist_info.is_rank_zero else (lambda _: None))
        torch.manual_seed(run.trainer.seed)
        self.streams = build_streams(run, dist_info)
        self.train_iter = iter(self.streams.train)
        sample = next(iter(self.streams.eval)) if run.data.eval_batches > 0 else peek(self.streams.train)
        self.parallel = build_parallel_model(run, dist_info, sample_batch=sample, run_dir=self.run_dir, log=self.log)
        self.model = self.parallel.model
        self.dense_optimizer = build_dense_optimizer(self.model.module, run)
        self.dense_params = [p for g in self.dense_optimizer.param_groups for p in g["params"]]
        self.sparse_optimizer = self.model.fused_optimizer
        self.callbacks = CallbackList(build_callbacks(run, self.run_dir, extra=extra_callbacks))
        self.autocast_dtype = AUTOCAST_DTYPES[run.precision.compute_dtype]
        self.checkpoint_root = checkpoint_root(run.trainer.checkpoint_dir, self.run_dir)
        self.state = TrainState(model=self.model, optimizers=(self.dense_optimizer, self.sparse_optimizer),
                                rank=dist_info.rank, world_size=dist_info.world_size, run_dir=self.run_dir,
                                total_steps=run.trainer.steps, device=dist_info.device)
        self.nonfinite = NonFiniteGuard(run.trainer.nonfinite, device=dist_info.device)
        self.warmup = None  # built by `fit` at its start step
        self._grad_norm_max: Optional[torch.Tensor] = None  # largest pre-clip dense gradient norm since the last log
        self._window: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._window_start = time.perf_counter()
        self._data_wait = DataWait()
        self._eval_size_said = False
        if run.data.eval_batches == 0:
            self.log("evaluation skipped: data.eval_batches=0 (no eval metrics in metrics.jsonl or summary.json)")
        if line := unread_sequences(run):
            self.log(line)
        if unread := run.data.unread_settings():
            self.log(f"data={run.data.name} does not read {', '.join(unread)}")

    # ---- loop -------------------------------------------------------------------------------------------
    def fit(self, start: int = 0) -> TrainState:
        """Train steps [`start`, stop): `start` is 0 or the step `restore` returned."""
        t = self.run.trainer
        last = (t.stop_after or t.steps) - 1
        self.state.step = start
        self.warmup = build_warmup(self.dense_optimizer, base_lr=t.lr, warmup_steps=t.warmup_steps, start_step=start)
        self.callbacks.fire("on_train_start", self.state)
        self._window_start = time.perf_counter()  # start-up and a checkpoint's restore are not training throughput
        stop = StopSignals(enabled=t.stop_on_signal, announce=self.dist.is_rank_zero)
        try:
            for step in range(start, last + 1):
                self.state.step = step
                with phase_range("data"), self._data_wait.timed():
                    batch = next(self.train_iter)
                self._train_step(batch)
                done = step + 1
                if t.eval_interval and done % t.eval_interval == 0 and done != t.steps:
                    self._raise_if_nonfinite()
                    with phase_range("eval"), self._outside_throughput():
                        self._evaluate()
                if _saved_at(t, done):
                    self._raise_if_nonfinite()
                    with phase_range("checkpoint"), self._outside_throughput():
                        self._save_checkpoint(done)
                # last: a resume at `done` runs neither the evaluation nor the periodic save of `done` again
                if done % t.log_interval == 0 and done <= last and (signum := stop.agreed(self.dist.device)):
                    self._stop_on_signal(signum, done)
            self.state.step = last  # the last step trained, also when a resume at the end trained none
            self._raise_if_nonfinite()
            if last + 1 == t.steps:
                self._evaluate()
                if t.checkpoint_at_end and start < t.steps and not _saved_at(t, t.steps):
                    self._save_checkpoint(t.steps)
            self._count_malformed_rows()
            self.callbacks.fire("on_train_end", self.state)
        except BaseException as exc:
            self.callbacks.fire("on_exception", self.state, exc)
            raise
        finally:
            stop.close()
        return self.state

    def _stop_on_signal(self, signum: int, done: int) -> None:
        """Every rank: save the state after `done` steps (unless the loop just saved it), then `RunStopped`."""
        self._raise_if_nonfinite()
        if not _saved_at(self.run.trainer, done):
            self._save_checkpoint(done)
        raise RunStopped(signum, step=done, checkpoint=self.state.checkpoint_dir)

    def _train_step(self, batch: Batch) -> None:
        """One step, in named phases (``profiling.trace_split.phase_range``, read by the profiler's per-step split)."""
        state = self.state
        with phase_range("data"):
            batch = batch.to(self.dist.device, non_blocking=True)
        state.batch_size = len(batch)
        state.metrics = {}
        with phase_range("callbacks"):
            self.callbacks.fire("on_step_start", state)
        self.model.train()
        with phase_range("forward"):
            with self._autocast():
                logits = self.model(batch).float()
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        state.loss = loss
        with phase_range("callbacks"):
            self.callbacks.fire("on_after_forward", state)
        if self.nonfinite.skip(loss, step=state.step + 1):  # before backward: the embedding update is in it
            state.skipped_steps = self.nonfinite.skipped_steps
            self.log(f"warning: step {state.step + 1}: non-finite loss, step skipped (no backward, no dense or "
                     f"embedding update; {state.skipped_steps} skipped so far)")
        else:
            with phase_range("backward"):  # the embeddings' fused optimizer runs in it
                loss.backward()
            with phase_range("callbacks"):
                self.callbacks.fire("on_after_backward", state)
            with phase_range("optimizer"):
                self.nonfinite.record_gradients((p.grad for p in self.dense_params), step=state.step + 1)
                if self.run.trainer.grad_clip_norm:
                    norm = clip_gradients(self.dense_params, self.run.trainer.grad_clip_norm)
                    self._grad_norm_max = (norm if self._grad_norm_max is None
                                           else torch.maximum(self._grad_norm_max, norm))
                self.dense_optimizer.step()
            self._window.append((loss.detach(), logits.detach(), batch.labels))
        with phase_range("optimizer"):
            self.dense_optimizer.zero_grad(set_to_none=True)
        if (state.step + 1) % self.run.trainer.log_interval == 0:
            with phase_range("metrics"):
                self._raise_if_nonfinite()  # nothing computed from a non-finite state is logged
                state.metrics = {**(self._window_metrics() if self._window else {}), **self._update_metrics(),
                                 "skipped_steps": self.nonfinite.skipped_steps}
        if self.warmup is not None:
            self.warmup.step()  # every step, skipped ones too: the learning rate follows the step number
        self.callbacks.fire("on_step_end", state)  # outside the phases: the profiler's step boundary is in it

    def _window_metrics(self) -> dict[str, float]:
        """Train metrics over the steps since the last log, over all ranks."""
        losses = torch.stack([w[0] for w in self._window])
        elapsed = time.perf_counter() - self._window_start
        metrics = CTRMetrics(device=self.dist.device)
        metrics.update(torch.cat([w[1] for w in self._window]), torch.cat([w[2] for w in self._window]))
        metrics = metrics.compute()
        wait_ms = torch.tensor(self._data_wait.take_ms_per_step(), device=losses.device)
        loss, data_wait_ms = _mean_over_ranks(torch.stack([losses.mean().float(), wait_ms]))
        out = {"loss": loss, "examples_per_s": metrics["examples"] / elapsed, "ne": metrics["ne"],
               "auc": metrics["auc"], "data_wait_ms": data_wait_ms}
        self._window, self._window_start = [], time.perf_counter()
        return out

    @contextlib.contextmanager
    def _outside_throughput(self):
        """Leave the time spent inside (an evaluation, a checkpoint save) out of the logged examples/s: the window's
        start moves later by as much, so the window's steps before it still count with their own time."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._window_start += time.perf_counter() - began

    def _update_metrics(self) -> dict[str, float]:
        """``lr`` (the dense learning rate of this step) under a warm-up; ``grad_norm_max`` (the largest dense
        gradient norm before clipping since the last log, all ranks) under clipping."""
        out = {}
        if self.warmup is not None:
            out["lr"] = self.dense_optimizer.param_groups[0]["lr"]
        if self._grad_norm_max is not None:
            out["grad_norm_max"] = self._grad_norm_max.item()
            self._grad_norm_max = None
        return out

    @torch.no_grad()
    def _evaluate(self) -> None:
        if self.run.data.eval_batches == 0:  # said once at start-up
            return
        self.callbacks.fire("on_eval_start", self.state)
        self.model.eval()
        metrics = CTRMetrics(device=self.dist.device)
        num_batches = 0
        for batch in _while_every_rank_has_one(self.streams.eval, self.dist.device):
            batch = batch.to(self.dist.device)
            with self._autocast():
                metrics.update(self.model(batch).float(), batch.labels)
            num_batches += 1
        if num_batches < self.run.data.eval_batches and not self._eval_size_said:
            self._eval_size_said = True
            self.log(f"evaluation covers {num_batches} batches per rank, not data.eval_batches="
                     f"{self.run.data.eval_batches}: the smallest rank's eval share holds no more full batches of "
                     f"data.batch_size={self.run.data.batch_size}")
        m = metrics.compute()
        self.state.eval_metrics = m = {f"eval_{k}": m[k] for k in ("logloss", "ne", "auc")}
        self.log(f"eval @ step {self.state.step + 1}: auc {m['eval_auc']:.4f}  logloss {m['eval_logloss']:.4f}  "
                 f"ne {m['eval_ne']:.4f}")
        self.callbacks.fire("on_eval_end", self.state)

    def _count_malformed_rows(self) -> None:
        """Skipped malformed data rows, summed over ranks (train and eval), into train.log and summary.json."""
        counts = torch.tensor([self.streams.train.num_malformed, self.streams.eval.num_malformed],
                              dtype=torch.int64, device=self.dist.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        train, evals = counts.tolist()
        self.state.counts["malformed_rows"] = train + evals
        if train + evals:
            self.log(f"malformed data rows skipped: {train + evals} (train {train}, eval {evals}; all ranks)")

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.autocast_dtype)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def _raise_if_nonfinite(self) -> None:
        """Collective: stop with one line if any rank met a non-finite loss or gradient since the start."""
        found = self.nonfinite.first_bad()
        if found is None:
            return
        kind, step = found
        policy = self.nonfinite.policy
        why = (" (skip_step skips a non-finite loss before backward; here the loss was finite and the embedding "
               "update had already happened inside backward)" if policy == "skip_step" else "")
        latest = self.state.checkpoint_dir
        raise NonFiniteError(f"non-finite {kind} at step {step} (trainer.nonfinite={policy}){why}: stopped at step "
                             f"{self.state.step + 1} without saving that state; latest checkpoint: "
                             f"{latest if latest is not None else 'none'}")

    def _save_checkpoint(self, done_steps: int) -> None:
        local = {"train_stream": self.streams.train.state_dict(),
                 "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks.callbacks}}
        path = ckpt.save_checkpoint(self.checkpoint_root, done_steps, model=self.model,
                                    dense_optimizer=self.dense_optimizer, sparse_optimizer=self.sparse_optimizer,
                                    extra={"step": done_steps, "skipped_steps": self.nonfinite.skipped_steps},
                                    local=local, rank=self.dist.rank, world_size=self.dist.world_size,
                                    model_identity=model_identity(
                                        self.run.model, loka_mods=self.run.precision.mods,
                                        dense_optimizer=self.run.trainer.dense_optimizer),
                                    precision=precision_identity(self.run.precision))
        self.state.checkpoint_dir = path
        self.log(f"checkpoint: {path}")
        self.callbacks.fire("on_checkpoint_save", self.state)

    def restore(self, path: Path) -> int:
        """Collective: load the complete checkpoint `path` (chosen by `resume.plan_start`); returns its step.
        `checkpoint.CheckpointError` (one line) when a file is refused or DCP cannot load it, and on every rank,
        naming the first failing rank, when a rank's saved data position or callback state does not fit."""
        extra, local = ckpt.load_checkpoint(path, model=self.model, dense_optimizer=self.dense_optimizer,
                                            sparse_optimizer=self.sparse_optimizer, extra_template={"step": 0},
                                            rank=self.dist.rank)
        self.nonfinite.skipped_steps = self.state.skipped_steps = int(extra.get("skipped_steps", 0))
        rank, world_size, failure = self.dist.rank, self.dist.world_size, None
        try:  # this rank's own state: no collective inside, the ranks agree on its outcome below
            self.streams.train.load_state_dict(local["train_stream"])
            for cb in self.callbacks.callbacks:
                if cb.state_key in local["callbacks"]:
                    cb.load_state_dict(local["callbacks"][cb.state_key])
            self.state.checkpoint_dir = path
            self.callbacks.fire("on_checkpoint_load", self.state)  # where a callback checks its state (the Probe)
        except (KeyError, ValueError, TypeError) as exc:
            whose = f"rank {rank}: " if world_size > 1 else ""
            failure = f"{path} does not fit this run ({whose}{type(exc).__name__}: {exc})"
        if (agreed := ckpt.agreed_failure(failure, rank=rank, world_size=world_size)) is not None:
            raise ckpt.CheckpointError(agreed)  # on every rank, with the first failing rank's line
        self.train_iter = iter(self.streams.train)
        self.log(f"resumed from {path} at step {extra['step']}")
        return int(extra["step"])


def _saved_at(t, done: int) -> bool:
    """Whether the loop already checkpointed after `done` steps."""
    return bool(t.checkpoint_interval and done % t.checkpoint_interval == 0) or done == t.stop_after


def _while_every_rank_has_one(stream, device: torch.device) -> Iterator[Batch]:
    """The batches of the finite ``stream`` as long as every rank still has one (a collective per batch).

    Why: the sharded forward runs all-to-alls, so a rank with one batch more would wait forever for the others;
    Criteo eval shares are byte ranges, and lines of other lengths or malformed rows leave one rank fewer full
    batches than another.
    """
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    batches = iter(stream)
    while True:
        batch = next(batches, None)
        if distributed:
            have = torch.tensor([batch is not None], dtype=torch.int32, device=device)
            dist.all_reduce(have, op=dist.ReduceOp.MIN)
            if not have.item():
                return
        elif batch is None:
            return
        yield batch


class DataWait:
    """Host time the loop spent waiting for its next train batch (the prefetch queue empty: data generation or
    reading is slower than the step), per step since the last ``take_ms_per_step``."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0

    @contextlib.contextmanager
    def timed(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - began
            self.steps += 1

    def take_ms_per_step(self) -> float:
        """Mean milliseconds per step waited since the last call (0.0 without steps); starts a new window."""
        ms = 1000.0 * self.seconds / self.steps if self.steps else 0.0
        self.seconds, self.steps = 0.0, 0
        return ms


def _mean_over_ranks(values: torch.Tensor) -> list[float]:
    """values: (V,) float32; each one's mean over ranks, in one all-reduce."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values)  # SUM: gloo has no AVG
        values /= dist.get_world_size()
    return values.tolist()
