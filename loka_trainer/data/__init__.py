"""Data layer: synthetic planted-teacher stream and Criteo TSV reader/writer behind one ``build_stream``.

    cfg = DataConfig(batch_size=512)                      # or Hydra: data=synthetic / data=criteo data.path=...
    schema = data_schema(cfg)                             # feature names + vocab sizes for the model
    train = build_stream(cfg, split="train", rank=r, world_size=w)   # infinite, resumable (state_dict)
    evals = build_stream(cfg, split="eval", rank=r, world_size=w)    # finite, same batches on every iter()
"""
from __future__ import annotations

import importlib
from typing import Any

from loka_trainer.data.config import DataConfig

# Everything else is imported on first use (PEP 562): validating a command line needs only DataConfig, and
# the rest pulls in TorchRec.
_LAZY = {
    "BatchStream": "base", "Batch": "batch", "DataSchema": "batch", "write_criteo_tsv": "criteo",
    "PrefetchStream": "prefetch", "data_schema": "schema", "DATA_SOURCES": "stream", "build_stream": "stream",
    "SyntheticSource": "synthetic", "WorkerProcessStream": "worker_processes",
}

__all__ = ["DataConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loka_trainer.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"loka_trainer.data.{_LAZY[name]}"), name)
