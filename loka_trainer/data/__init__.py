"""Data layer: synthetic planted-teacher stream and Criteo TSV reader/writer behind one ``build_stream``.

    cfg = DataConfig(batch_size=512)                      # or Hydra: data=synthetic / data=criteo data.path=...
    schema = data_schema(cfg)                             # feature names + vocab sizes for the model
    train = build_stream(cfg, split="train", rank=r, world_size=w)   # infinite, resumable (state_dict)
    evals = build_stream(cfg, split="eval", rank=r, world_size=w)    # finite, same batches on every iter()
"""
from __future__ import annotations

from loka_trainer.data.base import BatchStream
from loka_trainer.data.batch import Batch, DataSchema
from loka_trainer.data.config import DataConfig
from loka_trainer.data.criteo import write_criteo_tsv
from loka_trainer.data.prefetch import PrefetchStream
from loka_trainer.data.schema import data_schema
from loka_trainer.data.stream import DATA_SOURCES, build_stream
from loka_trainer.data.synthetic import SyntheticSource

__all__ = [
    "Batch", "BatchStream", "DATA_SOURCES", "DataConfig", "DataSchema", "PrefetchStream", "SyntheticSource",
    "build_stream",
    "data_schema", "write_criteo_tsv",
]
