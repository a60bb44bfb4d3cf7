"""``WorkerProcessStream``: the batches of a random-access train stream made by worker processes.

Why processes: on one H100, interformer_h200's train.py loop waited 19 ms per step for its data with one background
thread, and making the batches on four threads of the training process removed the wait but nearly halved the loop's
speed (`docs/results/train_throughput_interformer_h200/`): generation competed with the loop's host work in one
process. A ``torch.utils.data.DataLoader`` with ``workers`` processes (each on one torch thread, forked so the
stream needs no pickling; they never touch CUDA) makes batch p+k in worker k, hands them over in index order through
shared memory and pins them on its own thread. The position stays exact: ``state_dict`` is the stream's state after
the last batch *consumed*, so a checkpoint never skips the batches the workers made ahead.
"""
from __future__ import annotations

import itertools

from torch.utils.data import DataLoader, Dataset

from loka_trainer.data.base import BatchStream, IndexedStream
from loka_trainer.data.batch import Batch


class _BatchAt(Dataset):
    """Batch ``index`` of ``stream``, its KJTs' per-key lengths counted in the worker (off the training process)."""

    def __init__(self, stream: IndexedStream) -> None:
        self._stream = stream

    def __getitem__(self, index: int) -> Batch:
        return self._stream.batch_at(index).with_host_key_lengths()


class WorkerProcessStream(BatchStream):
    """Wraps an infinite ``IndexedStream``; ``depth`` batches are kept ready (at least one per worker), made by
    ``workers`` processes. ``pin_memory`` (only where CUDA is available: ``build_stream`` decides) for async H2D
    copies."""

    def __init__(self, stream: IndexedStream, *, depth: int = 2, workers: int = 2, pin_memory: bool = False) -> None:
        if not isinstance(stream, IndexedStream):
            raise ValueError(f"{workers} data workers need a random-access stream (IndexedStream), "
                             f"got {type(stream).__name__}, which is read in order")
        if stream.num_batches is not None:
            raise ValueError("WorkerProcessStream wraps infinite (train) streams only; eval streams restart on iter()")
        if depth < 1 or workers < 1:
            raise ValueError(f"prefetch depth and workers must be >= 1, got depth={depth}, workers={workers}")
        self._stream, self._depth, self._workers, self._pin = stream, depth, workers, pin_memory
        self._batches = None  # the DataLoader's iterator while the workers run

    def __next__(self) -> Batch:
        if self._batches is None:
            self._batches = iter(DataLoader(
                _BatchAt(self._stream), batch_size=None, sampler=itertools.count(self._stream.position),
                num_workers=self._workers, prefetch_factor=-(-self._depth // self._workers),
                multiprocessing_context="fork", pin_memory=self._pin))
        try:
            batch = next(self._batches)
        except BaseException:
            # Every batch before the failed one was consumed; the next ``next()`` starts the workers there again.
            self.close()
            raise
        self._stream.position += 1
        return batch

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
