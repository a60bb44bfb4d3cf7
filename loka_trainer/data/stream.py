"""``build_stream`` and the ``DATA_SOURCES`` registry behind it (name -> stream builder)."""
from __future__ import annotations

from typing import Callable

import torch

from loka_trainer.data.base import BatchStream, IndexedStream
from loka_trainer.data.config import DataConfig
from loka_trainer.data.criteo import build_criteo_stream
from loka_trainer.data.prefetch import PrefetchStream
from loka_trainer.data.synthetic import SyntheticSource

SPLITS = ("train", "eval")


def build_synthetic_stream(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> BatchStream:
    """Synthetic planted-teacher batches; train is infinite, eval has ``cfg.eval_batches`` batches per rank."""
    source = SyntheticSource(cfg)
    identity = {"source": "synthetic", "seed": cfg.seed, "split": split, "rank": rank, "world_size": world_size,
                "batch_size": cfg.batch_size}
    return IndexedStream(
        lambda index: source.batch_at(split, index, rank=rank, world_size=world_size),
        identity=identity,
        num_batches=cfg.eval_batches if split == "eval" else None,
    )


DATA_SOURCES: dict[str, Callable[..., BatchStream]] = {
    "synthetic": build_synthetic_stream,
    "criteo": build_criteo_stream,
}


def build_stream(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> BatchStream:
    """The batches of ``rank`` (of ``world_size``) for ``split`` ("train": infinite, "eval": finite).

    Train streams are wrapped in a ``PrefetchStream`` when ``cfg.prefetch > 0``.
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
        stream = PrefetchStream(stream, depth=cfg.prefetch, pin_memory=pin)
    return stream
