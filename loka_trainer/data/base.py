"""The stream interface the trainer iterates: ``BatchStream`` and the random-access ``IndexedStream``.

Train streams are infinite and continue where they are; eval streams are finite and restart on every ``iter()``,
so each evaluation sees the same batches.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator, Optional

from loka_trainer.data.batch import Batch


class BatchStream:
    """Iterator of CPU ``Batch``es with a resumable position (``state_dict`` / ``load_state_dict``).

    ``num_malformed`` counts input rows that were skipped (always 0 for the synthetic source).
    """

    num_batches: Optional[int] = None  # None: infinite

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        raise NotImplementedError

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an infinite (train) BatchStream has no len()")
        return self.num_batches

    def skip(self) -> None:
        """Move past the next batch; sources that can do so without making it override this."""
        next(self)

    def close(self) -> None:
        """Release what the stream holds open (a file, worker threads or processes); the next ``next()`` opens it
        again where the stream is. Nothing to release here."""

    @property
    def num_malformed(self) -> int:
        return 0

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


class IndexedStream(BatchStream):
    """A stream over a random-access ``batch_at(index)``: resuming at any position is O(1)."""

    def __init__(self, batch_at: Callable[[int], Batch], *, identity: dict, num_batches: Optional[int]) -> None:
        self._batch_at = batch_at
        self._identity = dict(identity)
        self.num_batches = num_batches
        self.position = 0

    def __iter__(self) -> Iterator[Batch]:
        if self.num_batches is not None:
            self.position = 0
        return self

    def __next__(self) -> Batch:
        if self.num_batches is not None and self.position >= self.num_batches:
            raise StopIteration
        batch = self._batch_at(self.position)
        self.position += 1
        return batch

    def batch_at(self, index: int) -> Batch:
        """Batch ``index``, the stream's position unchanged (what data worker processes call)."""
        return self._batch_at(index)

    def state_dict(self) -> dict:
        return {**self._identity, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        check_identity(self._identity, state)
        self.position = int(state["position"])


def peek(stream: BatchStream) -> Batch:
    """The next batch of ``stream``, which stays where it was: its next batch is that one again (the trainer's
    calibration sample must not shift the training data)."""
    position = stream.state_dict()
    batch = next(iter(stream))
    stream.load_state_dict(position)
    return batch


def check_identity(identity: dict, state: dict) -> None:
    """Refuse a state saved by a different stream (other seed, split, rank layout, source or data settings). A
    state that records fewer settings (a checkpoint written before they were recorded) resumes, with one warning
    naming what cannot be checked."""
    unrecorded = [key for key in identity if key not in state]
    if unrecorded:
        logging.getLogger("loka_trainer").warning(
            "data stream state records no %s (written before these were recorded): resuming without checking them",
            ", ".join(unrecorded))
    if (mismatch := identity_mismatch(identity, state)) is not None:
        raise ValueError(f"{mismatch}; resume with the same data config and world size")


def identity_mismatch(identity: dict, state: dict) -> Optional[str]:
    """The first setting of ``identity`` that a saved stream ``state`` records with another value, as one line;
    None when every recorded one matches (a setting ``state`` does not record is not compared)."""
    for key, value in identity.items():
        if key in state and state[key] != value:
            return f"data stream state has {key}={state[key]!r} but this stream has {key}={value!r}"
    return None
