"""Checkpoints with torch.distributed.checkpoint (DCP): sharded embeddings, FSDP2 dense, optimizers, data, RNG.

Layout under the checkpoint root::

    step_000300/            one DCP checkpoint (every rank writes its shards)
        .metadata, __*.distcp
        rank{r}.pt          per-rank state: RNG, data position, callbacks (DCP de-duplicates
                            non-tensor values across ranks, so values that differ per rank live here)
        complete.json       the completion marker, written last (see below)
    latest                  text file naming the newest complete step directory (for people; resume scans)

A save is complete only when ``complete.json`` exists: rank 0 writes it (atomic rename) once every rank has
written its ``rankN.pt`` (after DCP's ``.metadata``) and the ranks agreed that none failed; a write that fails on
any one rank stops every rank with the same one-line error. It records the model's identity (the settings that
decide its function, compared on resume before anything starts) and lists every file of the checkpoint with its size,
and a SHA-256 for the small files that are unpickled (``.metadata``, ``rankN.pt``). `verify_checkpoint` accepts a
directory only when the marker parses and every listed file exists with the recorded size and digest, so an
interrupted save, a deleted or truncated shard, or a rewritten rank file is never loaded. A directory without
a marker (an interrupted save, or one written before markers existed) is incomplete.

``rankN.pt`` is read with ``torch.load(weights_only=True)``: it holds only tensors and plain containers (the
RNG states are stored as tensors and lists), so a file holding any other pickled object is refused, not
executed. DCP's own ``.metadata`` is a pickle that DCP unpickles: a checkpoint directory must come from a
trusted source.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from loka_trainer.atomic_files import atomic_write, atomic_write_text

LATEST = "latest"
MARKER = "complete.json"
MARKER_FORMAT = 1
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"step_(\d{6,})")
# Flat FQN keys: DCP flattens nested optimizer param_groups differently on save and load otherwise.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with the reason in one line."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def rank_file(path: Path, rank: int) -> Path:
    return path / f"rank{rank}.pt"


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_NNNNNN`` directory under `root` as (step, path), newest first (complete or not)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The parsed marker of a complete checkpoint; `CheckpointError` with the reason when it is not complete.

    Reads only the marker, file sizes and the small files' digests; loads nothing."""
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"no {MARKER} (an interrupted save, or written before completion markers)")
    try:
        record = json.loads(marker.read_text())
        step, world_size, files = int(record["step"]), int(record["world_size"]), dict(record["files"])
        if record.get("format") != MARKER_FORMAT:
            raise ValueError(f"format {record.get('format')!r}, expected {MARKER_FORMAT}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{MARKER} is unreadable ({type(exc).__name__}: {exc})") from None
    if STEP_DIR.fullmatch(path.name) and int(STEP_DIR.fullmatch(path.name).group(1)) != step:
        raise CheckpointError(f"{MARKER} records step {step}, the directory name says otherwise")
    needed = {DCP_METADATA, *(rank_file(path, r).name for r in range(world_size))}
    if not needed <= files.keys():
        raise CheckpointError(f"{MARKER} does not list {', '.join(sorted(needed - files.keys()))}")
    for name, expected in sorted(files.items()):
        file = path / name
        if Path(name).name != name or not file.is_file():
            raise CheckpointError(f"{name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{name} has {size} bytes, {MARKER} recorded {expected['bytes']}")
        if "sha256" in expected and _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{name} has {size} bytes as recorded but different content (SHA-256 mismatch)")
    return {"step": step, "world_size": world_size, "files": files, "model": record.get("model"),
            "precision": record.get("precision")}


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain lists (loadable with ``torch.load(weights_only=True)``)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_rank_state(file: Path, *, mmap: bool = False) -> dict[str, Any]:
    """One rank's ``rankN.pt`` with ``weights_only=True``; `CheckpointError` (one line) for anything else. With
    ``mmap`` the tensors are mapped, not read: a look at their shapes costs no reading of their data."""
    try:
        state = torch.load(file, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{file} was refused by torch.load(weights_only=True): it holds more than "
                              f"tensors and plain containers ({first}); a checkpoint must come from a "
                              f"trusted source") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]})") from None
    if not isinstance(state, dict) or "rng" not in state:
        raise CheckpointError(f"{file} is not a rank state (a dict with 'rng')")
    return state


def _app_state(model: nn.Module, dense_optimizer: torch.optim.Optimizer, sparse_optimizer: Any,
               extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "dense_optimizer": get_optimizer_state_dict(_unwrap(model), dense_optimizer, options=_OPTIM_OPTIONS),
        "sparse_optimizer": sparse_optimizer.state_dict() if sparse_optimizer is not None else {},
        # One JSON string: DCP flattens nested non-tensor dicts differently on save and load.
        "extra": json.dumps(extra, sort_keys=True),
    }


def save_checkpoint(root: Path, step: int, *, model: nn.Module, dense_optimizer: torch.optim.Optimizer,
                    sparse_optimizer: Any, extra: dict[str, Any], local: dict[str, Any], rank: int,
                    world_size: int, model_identity: Optional[dict[str, Any]] = None,
                    precision: Optional[dict[str, Any]] = None) -> Path:
    """Collective: every rank calls it. `extra` (JSON-able) must be identical on all ranks; `local` is this
    rank's own state (data position, callback state: tensors and plain containers); the RNG state is added.
    `model_identity` (JSON-able: the settings that decide the model's function) goes into the marker, where a
    resume compares it before anything starts (`resume.plan_start`); `precision` (JSON-able:
    `precision.precision_identity`) goes there too, for a resume to name a change of it (`resume.precision_change`).

    Order: DCP shards + ``.metadata`` -> every ``rankN.pt`` -> the ranks agree (`agreed_failure`, which also waits
    for every rank's file) -> rank 0 writes ``complete.json`` and points ``latest`` at it -> the ranks agree. A
    crash anywhere before the marker leaves an incomplete directory. A failed write (a full disk), on any one rank,
    raises the same one-line `CheckpointError` on every rank, naming the first failing rank (DCP raises its own
    failure on every rank)."""
    path = step_dir(root, step)
    failure = None
    if rank == 0:  # a directory left by an interrupted save of this step must not look complete mid-rewrite
        failure = _attempt(lambda: (path / MARKER).unlink(missing_ok=True), path, rank=rank, world_size=world_size)
    try:
        metadata = dcp.save(_app_state(model, dense_optimizer, sparse_optimizer, extra), checkpoint_id=str(path))
    except (OSError, RuntimeError, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(save_failure(path, exc)) from None
    if failure is None:
        failure = _attempt(lambda: atomic_write(rank_file(path, rank),
                                                lambda f: torch.save({**local, "rng": rng_state()}, f)),
                           path, rank=rank, world_size=world_size)
    _raise_agreed(failure, rank=rank, world_size=world_size)
    if rank == 0:
        failure = _attempt(lambda: _write_marker(path, step=step, world_size=world_size,
                                                 shard_files=_shard_files(metadata, path),
                                                 model_identity=model_identity, precision=precision),
                           path, rank=rank, world_size=world_size)
        failure = failure or _attempt(lambda: atomic_write_text(root / LATEST, path.name), path, rank=rank,
                                      world_size=world_size, complete=True)
    _raise_agreed(failure, rank=rank, world_size=world_size)
    return path


def save_failure(path: Path, exc: BaseException, *, rank: Optional[int] = None, complete: bool = False) -> str:
    """One line for a checkpoint save that failed: the failing rank (``rank``, when there are several), its error
    and the space left where it was written (a full disk shows in DCP only as a short write). ``complete``: the
    marker was written, only ``latest`` was not."""
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    try:
        free = f"; {shutil.disk_usage(existing).free / 2**20:.0f} MiB free there"
    except OSError:
        free = ""
    where = f"rank {rank}: " if rank is not None else ""
    if complete:
        return (f"could not point {path.parent / LATEST} at checkpoint {path} ({where}{_dcp_failure(exc)}{free}): "
                f"the checkpoint is complete and a restart resumes from it")
    return (f"could not write checkpoint {path} ({where}{_dcp_failure(exc)}{free}): it is incomplete and a restart "
            f"skips it; the earlier complete checkpoints are untouched and a restart resumes from the newest")


def agreed_failure(failure: Optional[str], *, rank: int, world_size: int) -> Optional[str]:
    """Collective: the first failing rank's `failure` line on every rank, None when no rank failed (`failure`
    None). One all-reduce (the lowest failing rank), then one broadcast of its line only when a rank failed; it
    returns on a rank only after every rank called it."""
    if world_size <= 1 or not dist.is_initialized():
        return failure
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    first = torch.tensor([rank if failure is not None else world_size], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    source = int(first.item())
    if source == world_size:
        return None
    line = [failure]
    dist.broadcast_object_list(line, src=source)
    return line[0]


def _raise_agreed(failure: Optional[str], *, rank: int, world_size: int) -> None:
    """Collective: `CheckpointError` with the first failing rank's line on every rank when any rank failed."""
    agreed = agreed_failure(failure, rank=rank, world_size=world_size)
    if agreed is not None:
        raise CheckpointError(agreed)


def _attempt(action: Callable[[], Any], path: Path, *, rank: int, world_size: int,
             complete: bool = False) -> Optional[str]:
    """Run this rank's own part of a save; its failure as a `save_failure` line, or None."""
    try:
        action()
    except (OSError, RuntimeError) as exc:
        return save_failure(path, exc, rank=rank if world_size > 1 else None, complete=complete)
    return None


def load_checkpoint(path: Path, *, model: nn.Module, dense_optimizer: torch.optim.Optimizer,
                    sparse_optimizer: Any, extra_template: dict[str, Any], rank: int
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: restores model, optimizers and this rank's RNG in place; returns (`extra`, this rank's `local`).

    `path` must have passed `verify_checkpoint`. This rank's file is read first, so a refused file stops
    before any state changes; a DCP failure becomes a one-line `CheckpointError`."""
    local = load_rank_state(rank_file(path, rank))
    check_same_model(path, model)
    state = _app_state(model, dense_optimizer, sparse_optimizer, extra_template)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"{path} could not be loaded by torch.distributed.checkpoint "
                              f"({_dcp_failure(exc)}); was it written with another trainer.dense_optimizer or "
                              f"model? Resume with its settings, or set trainer.resume=false to start over") from None
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(_unwrap(model), dense_optimizer, state["dense_optimizer"],
                             options=_OPTIM_OPTIONS)
    if sparse_optimizer is not None:
        sparse_optimizer.load_state_dict(state["sparse_optimizer"])
    set_rng_state(local.pop("rng"))
    return json.loads(state["extra"]), local


def check_same_model(path: Path, model: nn.Module) -> None:
    """`CheckpointError` (one line) unless the checkpoint's model entries have this model's names and shapes.

    DCP loads only the entries the model asks for, so a checkpoint of another architecture (another ``model.*``
    setting, or the Mods, which drop biases) would otherwise resume with its extra parameters silently dropped."""
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - any failure to read DCP's metadata makes the checkpoint unusable
        raise CheckpointError(f"{path}/{DCP_METADATA} cannot be read ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:200]})") from None
    prefix = "model."
    found = {key[len(prefix):]: _shape(meta) for key, meta in stored.items() if key.startswith(prefix)}
    wanted = {key: _shape(value) for key, value in model.state_dict().items()}
    difference = model_difference(wanted, found)
    if difference:
        raise CheckpointError(
            f"{path} holds another model than this run builds ({difference}): was it written with other model= "
            f"or model.* settings, or another precision (the Mods drop biases)? Resume with the settings it was "
            f"written with, or set trainer.resume=false to start over")


def model_difference(wanted: dict[str, Optional[tuple[int, ...]]], found: dict[str, Optional[tuple[int, ...]]],
                     *, shown: int = 3) -> str:
    """'' when `found` (the checkpoint's entry -> shape) has exactly `wanted`'s names and shapes (None: no
    shape), else what differs, in one line naming at most `shown` entries per kind."""
    def names(keys: list[str]) -> str:
        return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")

    missing = sorted(wanted.keys() - found.keys())
    extra = sorted(found.keys() - wanted.keys())
    reshaped = sorted(k for k in wanted.keys() & found.keys() if wanted[k] != found[k])
    shapes = [f"{k} {list(found[k] or ())} vs {list(wanted[k] or ())}" for k in reshaped]
    parts = [f"{what} ({len(keys)}): {names(keys)}" for what, keys in (
        ("missing from the checkpoint", missing), ("not in this model", extra),
        ("of another shape, checkpoint vs model", shapes)) if keys]
    return "; ".join(parts)


def _shape(value: Any) -> Optional[tuple[int, ...]]:
    """A tensor's (global, for DTensor and ShardedTensor) or a DCP tensor entry's shape; None for other values."""
    size = getattr(value, "size", None)
    if callable(size):
        size = size()
    return tuple(size) if isinstance(size, torch.Size) else None


def _dcp_failure(exc: BaseException) -> str:
    """One line for a DCP failure: the first failing rank's own exception, not the traceback DCP formats."""
    if isinstance(exc, CheckpointException) and exc.failures:
        _, (exc, _trace) = min(exc.failures.items())
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


def _shard_files(metadata: Any, path: Path) -> list[str]:
    """The DCP data files of this save: from the returned metadata's storage info, else the directory listing."""
    storage = getattr(metadata, "storage_data", None) or {}
    names = {getattr(info, "relative_path", None) for info in storage.values()} - {None}
    return sorted(names) if names else sorted(p.name for p in path.glob("*.distcp"))


def _write_marker(path: Path, *, step: int, world_size: int, shard_files: list[str],
                  model_identity: Optional[dict[str, Any]] = None, precision: Optional[dict[str, Any]] = None
                  ) -> None:
    files: dict[str, dict[str, Any]] = {name: {"bytes": (path / name).stat().st_size} for name in shard_files}
    for name in (DCP_METADATA, *(rank_file(path, r).name for r in range(world_size))):
        files[name] = {"bytes": (path / name).stat().st_size, "sha256": _sha256(path / name)}
    record = {"format": MARKER_FORMAT, "step": step, "world_size": world_size, "files": files}
    if model_identity is not None:
        record["model"] = model_identity
    if precision is not None:
        record["precision"] = precision
    atomic_write_text(path / MARKER, json.dumps(record, indent=1, sort_keys=True) + "\n")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _unwrap(model: nn.Module) -> nn.Module:
    """DMP names parameters without its own "module." prefix; optimizer FQNs must come from the inner model."""
    return getattr(model, "module", model)


__all__ = ["CheckpointError", "LATEST", "MARKER", "agreed_failure", "check_same_model", "checkpoint_dirs",
           "load_checkpoint", "load_rank_state", "model_difference", "rng_state", "save_checkpoint", "save_failure",
           "set_rng_state", "step_dir", "verify_checkpoint"]
