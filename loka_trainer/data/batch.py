"""The batch every model consumes, and the schema that tells a model which features exist.

Notation: B local batch size, F_d dense features, F_s pooled sparse features, F_q sequence features.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclasses.dataclass(frozen=True)
class DataSchema:
    """Which features a data source produces; models size their embedding tables from it."""

    num_dense: int
    sparse_features: tuple[str, ...]
    sparse_vocab_sizes: tuple[int, ...]
    sequence_features: tuple[str, ...] = ()
    sequence_vocab_sizes: tuple[int, ...] = ()
    max_sequence_length: int = 0

    def __post_init__(self) -> None:
        assert len(self.sparse_features) == len(self.sparse_vocab_sizes)
        assert len(self.sequence_features) == len(self.sequence_vocab_sizes)


@dataclasses.dataclass
class Batch:
    """One local batch.

    dense:     (B, F_d) float32
    sparse:    KeyedJaggedTensor with keys ``schema.sparse_features`` (pooled: one or more ids per row and key)
    labels:    (B,) float32 in {0, 1}
    sequences: KeyedJaggedTensor with keys ``schema.sequence_features`` (ordered oldest→newest per row,
               variable length up to ``schema.max_sequence_length``), or None when the source has none
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    sequences: Optional[KeyedJaggedTensor] = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def with_host_key_lengths(self) -> "Batch":
        """This batch, its KJTs' per-key lengths counted on the host (``with_host_key_lengths``); the prefetch
        worker calls it off the training thread, ``to`` again (then a cache hit, ~2 µs)."""
        with_host_key_lengths(self.sparse)
        if self.sequences is not None:
            with_host_key_lengths(self.sequences)
        return self

    def pin_memory(self) -> "Batch":
        """This batch in pinned host memory (what ``DataLoader(pin_memory=True)`` calls), key lengths kept."""
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=self.sparse.pin_memory(),
            labels=self.labels.pin_memory(),
            sequences=None if self.sequences is None else self.sequences.pin_memory(),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The batch on ``device``; the KJTs carry their per-key lengths, counted on the host (see below)."""
        self.with_host_key_lengths()
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            sequences=None if self.sequences is None else self.sequences.to(device, non_blocking=non_blocking),
        )


def with_host_key_lengths(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``kjt`` with its per-key lengths and offsets cached as Python lists while it is still on the host.

    TorchRec's sharded input distribution reads them (``length_per_key()``); a KJT moved to the GPU without them
    computes them there and copies them to the host, a sync that makes the host wait for the GPU on every step
    instead of queueing the next step's work. ``KeyedJaggedTensor.to`` and ``pin_memory`` keep the cache.
    """
    if kjt.device().type == "cpu":
        kjt.length_per_key()
        kjt.offset_per_key()
    return kjt
