"""``build_stream`` and the ``DATA_SOURCES`` registry behind it (name -> stream builder)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from loka_trainer.data.base import BatchStream, IndexedStream
from loka_trainer.data.config import DataConfig
from loka_trainer.data.criteo import build_criteo_stream, criteo_identity
from loka_trainer.data.prefetch import PrefetchStream
from loka_trainer.data.synthetic import SyntheticSource
from loka_trainer.data.worker_processes import StridedWorkerStream, WorkerProcessStream
from loka_trainer.field_types import dotted

SPLITS = ("train", "eval")
# ``DataConfig`` fields that leave the synthetic batches as they are; every other one, ``outliers``' included, is
# part of a synthetic stream's identity, so that a resume with other data is refused rather than continuing one
# metrics series over two datasets.
SYNTHETIC_BATCH_INDEPENDENT = ("name", "eval_batches", "path", "eval_path", "eval_fraction", "prefetch", "workers",
                               "pin_memory")


def synthetic_identity(cfg: DataConfig) -> dict[str, Any]:
    """The settings that decide the synthetic batches, flat: ``{"seed": 0, ..., "outliers.spike_rate": 0.0}``."""
    return {key: value for key, value in dotted(dataclasses.asdict(cfg)).items()
            if key.split(".")[0] not in SYNTHETIC_BATCH_INDEPENDENT}


def synthetic_stream_identity(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> dict[str, Any]:
    """What a saved position of ``rank``'s synthetic stream must match (`synthetic_identity` and the rank layout)."""
    return {"source": "synthetic", "split": split, "rank": rank, "world_size": world_size, **synthetic_identity(cfg)}


def build_synthetic_stream(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> BatchStream:
    """Synthetic planted-teacher batches; train is infinite, eval has ``cfg.eval_batches`` batches per rank."""
    source = SyntheticSource(cfg)
    return IndexedStream(
        lambda index: source.batch_at(split, index, rank=rank, world_size=world_size),
        identity=synthetic_stream_identity(cfg, split=split, rank=rank, world_size=world_size),
        num_batches=cfg.eval_batches if split == "eval" else None,
    )


DATA_SOURCES: dict[str, Callable[..., BatchStream]] = {
    "synthetic": build_synthetic_stream,
    "criteo": build_criteo_stream,
}
# data.name -> what a saved stream position of that source must match, computed without building the stream
DATA_IDENTITIES: dict[str, Callable[..., dict[str, Any]]] = {
    "synthetic": synthetic_stream_identity,
    "criteo": criteo_identity,
}


def stream_identity(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> dict[str, Any]:
    """The identity ``build_stream`` gives the stream of ``rank`` for ``split`` (what its saved position must match),
    without building it: a resume compares it with a checkpoint's position before anything starts."""
    return DATA_IDENTITIES[cfg.name](cfg, split=split, rank=rank, world_size=world_size)


def build_stream(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> BatchStream:
    """The batches of ``rank`` (of ``world_size``) for ``split`` ("train": infinite, "eval": finite).

    Train streams are made ahead when ``cfg.prefetch > 0``: with ``cfg.workers > 1`` by that many processes
    (``WorkerProcessStream`` for a random-access source, the synthetic one; ``StridedWorkerStream`` for a file read
    in order, each worker reading it all and parsing every ``workers``-th batch), else on one background thread
    (``PrefetchStream``).
    """
    cfg.validate()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, "
                         f"got rank={rank}, world_size={world_size}")
    if cfg.name not in DATA_SOURCES:
        raise ValueError(f"data.name must be one of {sorted(DATA_SOURCES)}, got {cfg.name!r}")
    stream = DATA_SOURCES[cfg.name](cfg, split=split, rank=rank, world_size=world_size)
    if split == "train" and cfg.prefetch > 0:
        pin = cfg.pin_memory and torch.cuda.is_available()
        if cfg.workers > 1:
            by_workers = WorkerProcessStream if isinstance(stream, IndexedStream) else StridedWorkerStream
            return by_workers(stream, depth=cfg.prefetch, workers=cfg.workers, pin_memory=pin)
        stream = PrefetchStream(stream, depth=cfg.prefetch, pin_memory=pin)
    return stream
