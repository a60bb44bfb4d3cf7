"""Train batches made by worker processes: ``WorkerProcessStream`` (random-access streams) and
``StridedWorkerStream`` (streams read in order, such as a Criteo file).

Why processes: on one H100, interformer_h200's train.py loop waited 19 ms per step for its data with one background
thread, and making the batches on four threads of the training process removed the wait but nearly halved the loop's
speed (`docs/results/train_throughput_interformer_h200/`): generation competed with the loop's host work in one
process. Four worker processes removed the wait and ran that loop 1.30x faster than the one thread (same folder).
A ``torch.utils.data.DataLoader`` with ``workers`` processes (each on one torch thread, forked so the
stream needs no pickling; they never touch CUDA) makes batch p+k in worker k, hands them over in index order through
shared memory and pins them on its own thread. The position stays exact: ``state_dict`` is the stream's state after
the last batch *consumed*, so a checkpoint never skips the batches the workers made ahead.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Iterator, Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from loka_trainer.data.base import BatchStream, IndexedStream
from loka_trainer.data.batch import Batch


class _WorkerBatches(BatchStream):
    """The part both share: a DataLoader over ``_dataset()`` started at the first ``next()``, stopped by ``close``;
    ``_consume(item)`` moves the wrapped stream's position past the batch it hands out."""

    def __init__(self, stream: BatchStream, *, depth: int = 2, workers: int = 2, pin_memory: bool = False) -> None:
        if stream.num_batches is not None:
            raise ValueError(f"{type(self).__name__} wraps infinite (train) streams only; "
                             "eval streams restart on iter()")
        if depth < 1 or workers < 1:
            raise ValueError(f"prefetch depth and workers must be >= 1, got depth={depth}, workers={workers}")
        self._stream, self._depth, self._workers, self._pin = stream, depth, workers, pin_memory
        self._batches: Optional[Iterator] = None  # the DataLoader's iterator while the workers run

    def _dataset(self) -> Dataset:
        raise NotImplementedError

    def _sampler(self) -> Optional[Iterator[int]]:
        return None

    def _consume(self, item: Any) -> Batch:
        raise NotImplementedError

    def __next__(self) -> Batch:
        if self._batches is None:
            self._batches = iter(DataLoader(
                self._dataset(), batch_size=None, sampler=self._sampler(), num_workers=self._workers,
                prefetch_factor=-(-self._depth // self._workers), multiprocessing_context="fork",
                pin_memory=self._pin))
        try:
            item = next(self._batches)
        except BaseException:
            # Every batch before the failed one was consumed; the next ``next()`` starts the workers there again.
            self.close()
            raise
        return self._consume(item)

    @property
    def num_malformed(self) -> int:
        return self._stream.num_malformed

    def close(self) -> None:
        """Stop the workers and drop the batches they made ahead; the next ``next()`` resumes after the last
        consumed batch."""
        if self._batches is not None:
            # explicit: dropping the iterator stops them only once nothing else (a traceback) refers to it
            self._batches._shutdown_workers()
            self._batches = None

    def state_dict(self) -> dict:
        return self._stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._stream.load_state_dict(state)

    def __del__(self) -> None:
        if getattr(self, "_batches", None) is not None:  # __init__ may have raised before setting it
            self.close()


class _BatchAt(Dataset):
    """Batch ``index`` of ``stream``, its KJTs' per-key lengths counted in the worker (off the training process)."""

    def __init__(self, stream: IndexedStream) -> None:
        self._stream = stream

    def __getitem__(self, index: int) -> Batch:
        return self._stream.batch_at(index).with_host_key_lengths()


class WorkerProcessStream(_WorkerBatches):
    """Wraps an infinite ``IndexedStream``; ``depth`` batches are kept ready (at least one per worker), made by
    ``workers`` processes, worker k making batches p+k, p+k+workers, ... ``pin_memory`` (only where CUDA is
    available: ``build_stream`` decides) for async H2D copies."""

    def __init__(self, stream: IndexedStream, *, depth: int = 2, workers: int = 2, pin_memory: bool = False) -> None:
        if not isinstance(stream, IndexedStream):
            raise ValueError(f"{workers} data workers need a random-access stream (IndexedStream), "
                             f"got {type(stream).__name__}, which is read in order (StridedWorkerStream)")
        super().__init__(stream, depth=depth, workers=workers, pin_memory=pin_memory)

    def _dataset(self) -> Dataset:
        return _BatchAt(self._stream)

    def _sampler(self) -> Iterator[int]:
        return itertools.count(self._stream.position)

    def _consume(self, item: Batch) -> Batch:
        self._stream.position += 1
        return item


class _EveryNth(IterableDataset):
    """In worker k of n: from where ``stream`` was when the workers were forked, every n-th batch of it starting
    with the k-th, each with the stream's state after it. The DataLoader asks its workers in turn, so their batches
    arrive in the stream's order. Worker k > 0 passes silently over what worker 0 reads too (the warnings about
    malformed rows)."""

    def __init__(self, stream: BatchStream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[tuple[Batch, dict]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if worker:
            warnings.simplefilter("ignore")  # this process only: worker 0 reports each malformed row once
        stream = self._stream  # each worker's forked copy
        for _ in range(worker):
            stream.skip()
        while True:
            batch = next(stream).with_host_key_lengths()
            yield batch, stream.state_dict()
            for _ in range(workers - 1):
                stream.skip()


class StridedWorkerStream(_WorkerBatches):
    """Wraps an infinite stream read in order (``BatchStream.skip`` passes over a batch cheaper than making it: a
    Criteo file's lines are read and checked, not parsed). Each of ``workers`` processes reads the whole stream and
    makes every ``workers``-th batch, so up to ``workers`` batches are parsed at once while the reading is repeated
    in each (batch k from worker k mod workers). No line is sent between processes, and the batches and positions
    are those of one thread."""

    def _dataset(self) -> Dataset:
        self._stream.close()  # an open file forked into the workers would share its offset: each opens its own
        return _EveryNth(self._stream)

    def _consume(self, item: tuple[Batch, dict]) -> Batch:
        batch, state = item
        self._stream.load_state_dict(state)
        return batch
