"""Where a run starts, decided before anything in the run directory is written.

Rules (`docs/trainer.md`, "Run directory", states them for users):

- ``trainer.resume=true`` (default): the checkpoint directories are scanned newest first and the run continues
  from the newest *complete* one (`checkpoint.verify_checkpoint`); each newer incomplete one gets one warning
  line with the reason. If checkpoint directories exist and none is complete, the run stops with one line
  (exit 2) and changes nothing. A complete checkpoint written by another number of ranks also stops the run:
  per-rank data positions and RNG states cannot be redistributed; so does one written for another model (its
  marker's `model_identity`: every ``model.*`` setting and ``precision.mods``, e.g. an activation switched by
  ``model.mods.activation``, which no parameter shape would show).
- A run whose checkpoint already ends it (its step is ``trainer.stop_after`` or ``trainer.steps``: a finished run
  started again, e.g. by a scheduler, its ``summary.json`` written at that step) does nothing and changes nothing; a
  summary of another step (a shorter run's, continued with a higher ``trainer.steps``) does not count; a checkpoint
  past ``trainer.steps`` or ``trainer.stop_after`` stops the run with one line.
- A run never starts over silently. Starting at step 0 in a run directory that holds an earlier run's outputs
  (``trainer.resume=false``, or ``trainer.resume=true`` with no checkpoint at all) first moves those outputs
  (checkpoints, ``metrics.jsonl``, ``summary.json``, ``.hydra/``, ``train.log``, ``dispatch_plan.json``,
  ``profile.json``, ``tensorboard/``, ``probe/``) into ``<run dir>/previous/<date>_<time>/`` and says so. Nothing
  is deleted. A Probe writing to its own ``callbacks.probe.out_dir`` has an earlier run's files there (``stats.pt``
  and its report) moved to ``<out_dir>/previous/<date>_<time>/`` the same way.
- A checkpoint records its run's precision (``precision.precision_identity``); resuming it under another is
  named in one line (`precision_change`), not refused: the checkpoint holds no state of its precision.
- Resuming from step S keeps one series in ``metrics.jsonl``: records with ``step <= S`` stay, later ones
  (written after the checkpoint by the interrupted run; this run writes them again) are dropped, after the whole
  original file was copied to ``previous/<date>_<time>/metrics.jsonl``. Incomplete checkpoint directories newer
  than S move there too (this run writes those steps again), and ``latest`` names S.

`plan_start` only reads; `set_aside_previous_run` and `set_aside_probe_outputs` (fresh start) and
`prepare_resumed_run` (after a successful load) are rank 0's writes.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from loka_trainer.atomic_files import atomic_write_text
from loka_trainer.checkpoint import LATEST, CheckpointError, checkpoint_dirs, verify_checkpoint
from loka_trainer.field_types import dotted

PREVIOUS = "previous"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"  # written last, by the run's on_train_end: its presence marks a finished run
RUN_OUTPUTS = (".hydra", "train.log", METRICS_FILE, SUMMARY_FILE, "dispatch_plan.json", "profile.json", "tensorboard",
               "probe")
PROBE_OUTPUTS = ("stats.pt", "report.json", "report.md", "report.png")  # the Probe's statistics and report files


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """The resume decision: `checkpoint` None means step 0; `skipped` = newer incomplete checkpoints and why;
    `precision` = what the checkpoint records of its run's precision (`precision.precision_identity`; None when it
    records none)."""

    checkpoint: Optional[Path]
    step: int
    skipped: tuple[tuple[Path, str], ...] = ()
    precision: Optional[dict[str, Any]] = None

    def warnings(self) -> list[str]:
        return [f"warning: skipped checkpoint {path}: {reason}" for path, reason in self.skipped]


def checkpoint_root(checkpoint_dir: Optional[str], run_dir: Path) -> Path:
    """``trainer.checkpoint_dir``, default ``<run dir>/checkpoints``."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


def model_identity(model_config: Any, *, loka_mods: bool, dense_optimizer: str) -> dict[str, Any]:
    """The settings that decide a run's model function and the layout of its saved state, as JSON: every
    ``model.*`` field, whether the LoKA Mods replace the published blocks (``precision.mods``) and the dense
    optimizer (Adam's state loads into AdamW without a word). A checkpoint records it; a resume must match it."""
    return {"model": json.loads(json.dumps(dataclasses.asdict(model_config))), "precision.mods": bool(loka_mods),
            "trainer.dense_optimizer": dense_optimizer}


def identity_difference(saved: dict[str, Any], current: dict[str, Any], *, shown: int = 3) -> str:
    """'' when equal; else the differing settings, 'key: saved there, current here', at most `shown` of them. A
    setting ``saved`` does not record (a checkpoint written before it was recorded) is not compared."""
    a, b = dotted(saved), dotted(current)
    keys = sorted(k for k in a.keys() | b.keys() if k in a and a[k] != b.get(k, "(unset)"))
    parts = [f"{k}={json.dumps(a.get(k, '(unset)'))} there, {json.dumps(b.get(k, '(unset)'))} here"
             for k in keys[:shown]]
    return "; ".join(parts) + (f"; and {len(keys) - shown} more" if len(keys) > shown else "")


def precision_change(saved: Optional[dict[str, Any]], current: dict[str, Any], *, checkpoint: Path
                     ) -> Optional[str]:
    """A line to log when a run resumes from ``checkpoint`` under another precision than the ``saved`` one it
    records (both `precision.precision_identity`); None when they are the same, or the checkpoint records none.
    Named, not refused: a checkpoint holds no state of its precision (parameters and optimizer state keep their own
    dtype under every preset, with the same state_dict keys; FP8 casts and their scales are made afresh from them
    at each step; the Probe's statistics are of the high-precision operands), so a switch (BF16 to FP8 after a
    warm-up, FP8 back to BF16) is the user's to make. Settings are compared where both runs read them."""
    if saved is None or saved == current:
        return None
    parts = []
    if (saved.get("name"), saved.get("runs_as")) != (current["name"], current["runs_as"]):
        parts.append(f"precision={saved.get('name')} ({saved.get('runs_as')}) there, precision={current['name']} "
                     f"({current['runs_as']}) here")
    shared = {k: v for k, v in saved.get("settings", {}).items() if k in current["settings"]}
    if difference := identity_difference(shared, current["settings"]):
        parts.append(difference)
    if not parts:
        return None
    return (f"resuming from {checkpoint} under another precision than it was trained with: {'; '.join(parts)}; "
            f"it holds no state of its precision (parameters and optimizer state in their own dtype, FP8 scales made "
            f"afresh each step), so training continues from it under this run's")


def plan_start(checkpoint_root: Path, *, resume: bool, world_size: int,
               identity: Optional[dict[str, Any]] = None) -> StartPlan:
    """Decide where the run starts (reads only). `CheckpointError` when checkpoints exist and none is usable, or
    when the newest complete one was written for another model than `identity` (`model_identity`; a checkpoint
    that records none is not compared)."""
    if not resume:
        return StartPlan(checkpoint=None, step=0)
    found = checkpoint_dirs(checkpoint_root)
    skipped: list[tuple[Path, str]] = []
    for step, path in found:
        try:
            record = verify_checkpoint(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        if record["world_size"] != world_size:
            raise CheckpointError(
                f"checkpoint {path} was written by {record['world_size']} rank(s) and this run has {world_size}: "
                f"restart with {record['world_size']} rank(s), or trainer.resume=false to start over")
        if identity is not None and record.get("model") is not None:
            difference = identity_difference(record["model"], identity)
            if difference:
                raise CheckpointError(
                    f"checkpoint {path} was written for another model ({difference}); nothing was changed: resume "
                    f"with its settings, or set trainer.resume=false to start over")
        return StartPlan(checkpoint=path, step=step, skipped=tuple(skipped), precision=record.get("precision"))
    if found:
        reasons = "; ".join(f"{p.name}: {r}" for p, r in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        raise CheckpointError(
            f"no complete checkpoint among the {len(found)} in {checkpoint_root} ({reasons}); nothing was changed: "
            f"repair them, or set trainer.resume=false to start over (they are then moved to "
            f"{PREVIOUS}/ in the run directory)")
    return StartPlan(checkpoint=None, step=0)


def nothing_left(start: StartPlan, *, steps: int, stop_after: Optional[int] = None,
                 finished: bool = True) -> Optional[str]:
    """A line to print when the checkpoint the run resumes from already ends it (its step is ``stop_after`` or
    ``steps``) and the run ``finished`` (its summary was written at that step, `summary_steps`): nothing is
    written. A run stopped between its last checkpoint and its summary resumes there instead, for the final
    evaluation and summary. `CheckpointError` when the checkpoint lies past ``steps`` or ``stop_after``."""
    if start.checkpoint is None:
        return None
    end, field = (stop_after, "stop_after") if stop_after is not None else (steps, "steps")
    for limit, name in ((steps, "steps"), (end, field)):
        if start.step > limit:
            raise CheckpointError(f"the newest complete checkpoint {start.checkpoint} is at step {start.step}, past "
                                  f"trainer.{name}={limit}: raise trainer.{name} to go on from it, or set "
                                  f"trainer.resume=false to start over")
    if start.step < end or not finished:
        return None
    return (f"nothing to do: the checkpoint {start.checkpoint} is at step {start.step}, trainer.{field}={end}; "
            f"the run's outputs are left as they are (raise trainer.steps to train further)")


def summary_steps(run_dir: Path) -> Optional[int]:
    """The ``steps`` that ``run_dir``'s ``summary.json`` records (the step its run ended at); None when there is no
    summary or it cannot be read. A summary of another step (a shorter run's, continued with a higher
    ``trainer.steps``) does not mark the run at the newest checkpoint as finished."""
    try:
        return int(json.loads((Path(run_dir) / SUMMARY_FILE).read_text())["steps"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None


def set_aside_previous_run(run_dir: Path, checkpoint_root: Path, *, inputs: Sequence[Path] = ()) -> list[str]:
    """Before a run starts at step 0: move an earlier run's outputs into ``previous/<stamp>/``; lines to log.
    A file the new run reads (``inputs``, e.g. ``precision.plan`` pointing at the run's own plan file, or the report
    in ``probe/`` that ``precision.probe_stats`` names) is copied there instead, and stays in place."""
    ckpt_entries = [p for _, p in checkpoint_dirs(checkpoint_root)]
    if (checkpoint_root / LATEST).is_file():
        ckpt_entries.append(checkpoint_root / LATEST)
    outputs = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not ckpt_entries and not outputs:
        return []
    dest = _new_previous_dir(run_dir)
    _move_aside(outputs, dest, inputs=inputs)
    if ckpt_entries:
        (dest / "checkpoints").mkdir()
        for path in ckpt_entries:
            shutil.move(str(path), str(dest / "checkpoints" / path.name))
    moved = ", ".join([p.name for p in outputs] + ([f"{len(ckpt_entries)} checkpoint entries"] if ckpt_entries
                                                    else []))
    return [f"starting at step 0: the earlier run's outputs ({moved}) were moved to {dest}"]


def set_aside_probe_outputs(out_dir: Path, *, inputs: Sequence[Path] = ()) -> list[str]:
    """Before a run starts at step 0 with its Probe writing to ``callbacks.probe.out_dir``: move an earlier run's
    Probe files there (``PROBE_OUTPUTS``: its ``stats.pt`` and report) into ``<out_dir>/previous/<stamp>/``, as
    `set_aside_previous_run` does with ``<run dir>/probe``; other files there stay. A file the new run reads
    (``inputs``, e.g. the ``precision.probe_stats`` report) is copied there instead, and stays. Lines to log."""
    outputs = [out_dir / name for name in PROBE_OUTPUTS if (out_dir / name).is_file()]
    if not outputs:
        return []
    dest = _new_previous_dir(out_dir)
    _move_aside(outputs, dest, inputs=inputs)
    return [f"starting at step 0: the earlier run's Probe files in callbacks.probe.out_dir "
            f"({', '.join(p.name for p in outputs)}) were moved to {dest}"]


def prepare_resumed_run(run_dir: Path, checkpoint_root: Path, plan: StartPlan, *, steps: int) -> list[str]:
    """After a successful load at step S: newer incomplete checkpoints, metrics records after S (and the final
    evaluation's, at S = ``steps``: it follows the last checkpoint and runs again) and records that do not parse
    (a write cut short) go to ``previous/<stamp>/``; ``latest`` names S. Returns lines to log."""
    assert plan.checkpoint is not None
    lines: list[str] = []
    dest: Optional[Path] = None
    newer = [path for step, path in checkpoint_dirs(checkpoint_root) if step > plan.step]
    if newer:
        dest = _new_previous_dir(run_dir)
        (dest / "checkpoints").mkdir()
        for path in newer:
            shutil.move(str(path), str(dest / "checkpoints" / path.name))
        lines.append(f"moved {len(newer)} incomplete checkpoint(s) newer than step {plan.step} to "
                     f"{dest / 'checkpoints'}")
    metrics = run_dir / METRICS_FILE
    if metrics.is_file():
        text = metrics.read_bytes().decode("utf-8", errors="replace")
        kept, dropped = _split_records(text.splitlines(), plan.step, final=plan.step == steps)
        if dropped or not text.endswith("\n"):
            dest = dest or _new_previous_dir(run_dir)
            shutil.copy2(metrics, dest / METRICS_FILE)
            atomic_write_text(metrics, "".join(line + "\n" for line in kept))
            lines.append(f"{METRICS_FILE}: kept the records up to step {plan.step}; the {len(dropped)} others "
                         f"(after it, or cut short) are in {dest / METRICS_FILE}")
    latest = checkpoint_root / LATEST
    if latest.exists() and not latest.is_file():  # only a pointer: set aside whatever stands there
        dest = dest or _new_previous_dir(run_dir)
        shutil.move(str(latest), str(dest / LATEST))
        lines.append(f"checkpoints/{LATEST} was not a file: moved to {dest / LATEST}")
    if not latest.is_file() or latest.read_text(errors="replace").strip() != plan.checkpoint.name:
        atomic_write_text(latest, plan.checkpoint.name)
    return lines


def _split_records(lines: list[str], step: int, *, final: bool = False) -> tuple[list[str], list[str]]:
    """(records with step <= `step`, the others: later ones, with ``final`` the evaluation at `step`, and lines
    that do not parse as a record)."""
    kept, dropped = [], []
    for line in lines:
        try:
            record = json.loads(line)
            at = int(record["step"])
        except (ValueError, KeyError, TypeError):
            dropped.append(line)
            continue
        redone = at > step or (final and at == step and any(k.startswith("eval_") for k in record))
        (dropped if redone else kept).append(line)
    return kept, dropped


def _move_aside(paths: Sequence[Path], dest: Path, *, inputs: Sequence[Path] = ()) -> None:
    """Move each of ``paths`` into ``dest``; a file among ``inputs`` is copied instead, and one inside a moved
    folder (``precision.probe_stats=<run dir>/probe``) is copied back to its place: the run reads it."""
    kept = {q.resolve() for q in inputs if q.is_file()}
    for path in paths:
        if path.resolve() in kept:
            shutil.copy2(str(path), str(dest / path.name))
            continue
        inside = [q.relative_to(path.resolve()) for q in kept if q.is_relative_to(path.resolve())]
        shutil.move(str(path), str(dest / path.name))
        for rel in inside:
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(str(dest / path.name / rel), str(path / rel))


def move_to_previous(run_dir: Path, paths: Sequence[Path]) -> Path:
    """Move each of ``paths`` into a new ``<run_dir>/previous/<date>_<time>/`` (nothing is deleted); returns it."""
    dest = _new_previous_dir(run_dir)
    _move_aside(paths, dest)
    return dest


def _new_previous_dir(run_dir: Path) -> Path:
    base = run_dir / PREVIOUS / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    path.mkdir(parents=True)
    return path


__all__ = ["SUMMARY_FILE", "StartPlan", "checkpoint_root", "identity_difference", "model_identity",
           "move_to_previous", "nothing_left", "plan_start", "precision_change", "prepare_resumed_run",
           "set_aside_previous_run", "set_aside_probe_outputs", "summary_steps"]
