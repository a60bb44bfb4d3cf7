"""Built-in observers on rank 0: metrics.jsonl + summary.json, TensorBoard scalars, a progress bar.

Run-directory contract (other tools and tests rely on it):
- ``metrics.jsonl``: one JSON object per logged step (``step, loss, examples_per_s``, train ``ne, auc``,
  ``data_wait_ms`` (host ms per step spent waiting for the next train batch, mean over ranks) and
  ``skipped_steps``, the running count of steps skipped for a non-finite loss; a logged step whose whole window
  was skipped has only ``step, skipped_steps``) and per evaluation (``step, eval_auc, eval_logloss, eval_ne``);
  appended across resumes (a resume first drops the records after its checkpoint: `loka_trainer.resume`).
- ``summary.json``: written at the end (model, precision, world_size, steps, final eval metrics, mean examples_per_s
  over every step the run logged, a resumed run's steps before its checkpoint included (the checkpoint keeps them;
  null when none), skipped_steps, the run totals in ``TrainState.counts`` such as ``malformed_rows``, and on CUDA
  ``peak_gpu_memory_gib``: rank 0's allocator high-water mark from the first step on, i.e. training and evaluation
  with FP8 weight caches and kept activations, not the model build or the Dispatch plan's timing); where it ran:
  ``device`` (the CUDA device's name, else ``cpu``), ``torch`` (version) and ``finished`` (UTC time, ISO 8601).
- ``tensorboard/``: event files (scalars under ``train/`` and ``eval/``).
"""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any, Optional

import torch

from loka_trainer.atomic_files import atomic_write_text
from loka_trainer.callbacks.base import Callback, TrainState


class MetricsLogger(Callback):
    """Appends logged train metrics and eval results to `run_dir/metrics.jsonl`; writes `summary.json` at the end."""

    def __init__(self, run_dir: Path, *, run_info: dict[str, Any]):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.summary_path = Path(run_dir) / "summary.json"
        self.run_info = dict(run_info)
        self.throughputs: list[float] = []
        self.last_eval: dict[str, float] = {}

    def on_train_start(self, state: TrainState) -> None:
        if state.is_rank_zero and state.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(state.device)

    def on_step_end(self, state: TrainState) -> None:
        if state.is_rank_zero and state.metrics:
            if "examples_per_s" in state.metrics:
                self.throughputs.append(state.metrics["examples_per_s"])
            self._append({"step": state.step + 1, **state.metrics})

    def on_eval_end(self, state: TrainState) -> None:
        if state.is_rank_zero:
            self.last_eval = dict(state.eval_metrics)
            self._append({"step": state.step + 1, **state.eval_metrics})

    def on_train_end(self, state: TrainState) -> None:
        if not state.is_rank_zero:
            return
        mean_throughput = sum(self.throughputs) / len(self.throughputs) if self.throughputs else float("nan")
        summary = {**self.run_info, "world_size": state.world_size, "steps": state.step + 1,
                   **self.last_eval, "examples_per_s": mean_throughput, "skipped_steps": state.skipped_steps,
                   **state.counts}
        if state.device.type == "cuda":
            summary["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(state.device) / 2**30
        summary.update(device=torch.cuda.get_device_name(state.device) if state.device.type == "cuda" else "cpu",
                       torch=torch.__version__,
                       finished=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        atomic_write_text(self.summary_path, json.dumps(_finite_or_none(summary), indent=2) + "\n")  # tools read it

    def state_dict(self) -> dict[str, Any]:
        """What summary.json is computed from, so that a resumed run's summary covers the steps before its
        checkpoint too (rank 0's; the other ranks' lists stay empty)."""
        return {"throughputs": list(self.throughputs), "last_eval": dict(self.last_eval)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.throughputs = [float(v) for v in state_dict.get("throughputs", [])]
        self.last_eval = dict(state_dict.get("last_eval", {}))

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(_finite_or_none(record)) + "\n")


class TensorBoardLogger(Callback):
    """Scalars under `run_dir/tensorboard`: train/<metric> per logged step, eval/<metric> per evaluation."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.writer = None

    def on_train_start(self, state: TrainState) -> None:
        if not state.is_rank_zero:
            return
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run (state.step = its checkpoint's step S) hides what an earlier run logged after S, as
        # metrics.jsonl drops those records: TensorBoard shows one series. Resumed at the last step, it evaluates
        # S again: TensorBoard hides whole steps only, so S goes too and the train scalars kept at S are rewritten.
        final = bool(state.step) and state.step == state.total_steps
        purge_step = (state.step if final else state.step + 1) if state.step else None
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        if final and state.run_dir is not None:
            for record in _records_at(Path(state.run_dir) / "metrics.jsonl", state.step):
                if not any(key.startswith("eval_") for key in record):
                    self._add("train", record, state.step)

    def on_step_end(self, state: TrainState) -> None:
        if self.writer is not None and state.metrics:
            self._add("train", state.metrics, state.step + 1)

    def _add(self, prefix: str, metrics: dict[str, Any], step: int) -> None:
        for key, value in metrics.items():
            if key != "step" and value is not None:
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def on_eval_end(self, state: TrainState) -> None:
        if self.writer is not None:
            for key, value in state.eval_metrics.items():
                self.writer.add_scalar(f"eval/{key.removeprefix('eval_')}", value, state.step + 1)

    def on_train_end(self, state: TrainState) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        self.on_train_end(state)


class ProgressBar(Callback):
    """tqdm bar on rank 0: step, examples/s and the last logged loss."""

    def __init__(self) -> None:
        self.bar: Optional[Any] = None

    def on_train_start(self, state: TrainState) -> None:
        if state.is_rank_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.total_steps, initial=state.step, desc="train", unit="step",
                            dynamic_ncols=True)

    def on_step_end(self, state: TrainState) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if "loss" in state.metrics:
            self.bar.set_postfix(loss=f"{state.metrics['loss']:.4f}",
                                 ex_per_s=f"{state.metrics['examples_per_s']:.0f}")

    def on_train_end(self, state: TrainState) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        self.on_train_end(state)


def _records_at(path: Path, step: int) -> list[dict[str, Any]]:
    """The records of `path` (metrics.jsonl) logged at `step` (none when it does not exist)."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("step") == step]


def _finite_or_none(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: write null for non-finite floats."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
