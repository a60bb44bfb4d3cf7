"""Checkpoints with torch.distributed.checkpoint (DCP): sharded embeddings, FSDP2 dense, optimizers, data, RNG.

Layout under the checkpoint root::

    step_000300/            one DCP checkpoint (every rank writes its shards)
        .metadata, __*.distcp
        rank{r}.pt          per-rank state: RNG, data position, callbacks (DCP de-duplicates
                            non-tensor values across ranks, so values that differ per rank live here)
    latest                  text file naming the newest complete step directory, written last (atomic rename)

A step directory without ``latest`` pointing at it is an interrupted save and is never loaded.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

LATEST = "latest"
# Flat FQN keys: DCP flattens nested optimizer param_groups differently on save and load otherwise.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under `root`, or None."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if (path / ".metadata").is_file() else None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
                    sparse_optimizer: Any, extra: dict[str, Any], local: dict[str, Any], rank: int) -> Path:
    """Collective: every rank calls it. `extra` (JSON-able) must be identical on all ranks; `local` is this
    rank's own state (data position, callback state); the RNG state is added to it."""
    path = step_dir(root, step)
    dcp.save(_app_state(model, dense_optimizer, sparse_optimizer, extra), checkpoint_id=str(path))
    torch.save({**local, "rng": rng_state()}, path / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, root / LATEST)
    _barrier()
    return path


def load_checkpoint(path: Path, *, model: nn.Module, dense_optimizer: torch.optim.Optimizer,
                    sparse_optimizer: Any, extra_template: dict[str, Any], rank: int
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: restores model, optimizers and this rank's RNG in place; returns (`extra`, this rank's `local`)."""
    state = _app_state(model, dense_optimizer, sparse_optimizer, extra_template)
    dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(_unwrap(model), dense_optimizer, state["dense_optimizer"],
                             options=_OPTIM_OPTIONS)
    if sparse_optimizer is not None:
        sparse_optimizer.load_state_dict(state["sparse_optimizer"])
    local_file = path / f"rank{rank}.pt"
    if not local_file.is_file():
        raise ValueError(f"checkpoint {path} has no state for rank {rank}: resume with the same world size")
    local = torch.load(local_file, weights_only=False)
    set_rng_state(local.pop("rng"))
    return json.loads(state["extra"]), local


def _unwrap(model: nn.Module) -> nn.Module:
    """DMP names parameters without its own "module." prefix; optimizer FQNs must come from the inner model."""
    return getattr(model, "module", model)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
