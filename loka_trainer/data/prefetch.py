"""``PrefetchStream``: produce the next batches of a train stream on background threads.

Why: generating or parsing a batch costs milliseconds of CPU that would otherwise sit on the training step's
critical path (and distort step-time ratios measured on the GPU). Torch ops release the GIL, so one thread
overlaps generation with the step; a random-access stream (``IndexedStream``: the synthetic source) can be made by
``workers`` threads at once, worker k making batches p+k, p+k+W, ... from position p, consumed in order: for a
step shorter than the making of one batch. The position stays
exact: every queued batch carries the state of the underlying stream right after it, and ``state_dict`` returns
the state after the last batch *consumed*, so a checkpoint never skips the batches still in the queues.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import queue
import threading
import weakref
from typing import Callable, Iterator

from loka_trainer.data.base import BatchStream, IndexedStream
from loka_trainer.data.batch import Batch

_STOP = object()
# Streams whose worker runs. A daemon thread still inside a torch op when the interpreter finalizes aborts the
# process ("terminate called without an active exception", exit 134), so the workers are stopped at exit.
_RUNNING: "weakref.WeakSet[PrefetchStream]" = weakref.WeakSet()


class PrefetchStream(BatchStream):
    """Wraps an infinite ``BatchStream``; ``depth`` batches are kept ready (at least one per worker), made by
    ``workers`` threads (more than one: ``stream`` must be an ``IndexedStream``). ``pin_memory`` for async H2D
    copies."""

    def __init__(self, stream: BatchStream, *, depth: int = 2, workers: int = 1, pin_memory: bool = False) -> None:
        if stream.num_batches is not None:
            raise ValueError("PrefetchStream wraps infinite (train) streams only; eval streams restart on iter()")
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        if workers < 1:
            raise ValueError(f"prefetch workers must be >= 1, got {workers}")
        if workers > 1 and not isinstance(stream, IndexedStream):
            raise ValueError(f"{workers} prefetch workers need a random-access stream (IndexedStream), "
                             f"got {type(stream).__name__}, which is read in order")
        self._stream, self._depth, self._workers, self._pin = stream, depth, workers, pin_memory
        self._state = stream.state_dict()
        self._malformed = stream.num_malformed
        self._queues: list[queue.Queue] = []  # worker k's batches; the consumer takes them round robin
        self._threads: list[threading.Thread] = []
        self._consumed = 0  # batches consumed since the workers started
        self._stop = threading.Event()  # replaced per start, so a stopped worker never sees a cleared event

    @property
    def num_malformed(self) -> int:
        """Malformed rows the wrapped stream had met when it produced the last batch consumed: rows the worker
        skipped further ahead are not counted yet, so the count does not depend on ``depth``."""
        return self._malformed

    def __next__(self) -> Batch:
        if not self._threads:
            self._start()
        item = self._queues[self._consumed % self._workers].get()
        if isinstance(item, BaseException):
            # Every batch before the failed one was consumed. One worker reads the wrapped stream in order, which
            # the error left where it is, exactly as without prefetching; several read it by index, so it is put
            # at the failed batch. The workers have stopped.
            self._stop_worker()
            if self._workers > 1:
                self._stream.load_state_dict(self._state)
            raise item
        batch, self._state, self._malformed = item
        self._consumed += 1
        return batch

    def _start(self) -> None:
        self._stop, self._consumed = threading.Event(), 0
        per_worker = -(-self._depth // self._workers)
        self._queues = [queue.Queue(maxsize=per_worker) for _ in range(self._workers)]
        # NOTE: a worker gets its inputs, not ``self``: a thread holding ``self`` would keep an abandoned
        # stream (and its threads) alive forever; this way ``__del__`` can stop them.
        if self._workers == 1:
            sources = [functools.partial(_next_in_order, self._stream)]
        else:
            first = self._stream.position
            sources = [functools.partial(_next_by_index, self._stream, itertools.count(first + k, self._workers))
                       for k in range(self._workers)]
        self._threads = [threading.Thread(target=_work, args=(source, out, self._stop, self._pin),
                                          name=f"loka-data-prefetch-{k}", daemon=True)
                         for k, (source, out) in enumerate(zip(sources, self._queues))]
        for thread in self._threads:
            thread.start()
        _RUNNING.add(self)

    def _stop_worker(self) -> bool:
        if not self._threads:
            return False
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        _RUNNING.discard(self)
        return True

    def close(self) -> None:
        """Stop the worker and drop queued batches; the next ``next()`` resumes after the last consumed batch."""
        if self._stop_worker():
            self._stream.load_state_dict(self._state)  # rewind past the batches the worker ran ahead

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._stream.load_state_dict(state)
        self._state, self._malformed = self._stream.state_dict(), self._stream.num_malformed

    def __del__(self) -> None:
        if getattr(self, "_threads", None):  # __init__ may have raised before setting them
            self._stop_worker()


@atexit.register
def _stop_running_workers() -> None:
    for stream in list(_RUNNING):
        stream._stop_worker()


def _work(next_item: Callable[[], tuple[Batch, dict, int]], out: queue.Queue, stop: threading.Event,
          pin: bool) -> None:
    """Worker loop: ``next_item()`` (a batch, and the state and malformed count of the stream right after it) into
    ``out`` until ``stop``; errors go in too, where their batch would have."""
    try:
        while not stop.is_set():
            batch, state, malformed = next_item()
            _put(out, stop, (_ready(batch, pin), state, malformed))
    except BaseException as err:  # handed to the consumer, which re-raises it on its own thread
        _put(out, stop, err)


def _next_in_order(stream: BatchStream) -> tuple[Batch, dict, int]:
    """The one worker of a stream read in order: its next batch."""
    batch = next(stream)
    return batch, stream.state_dict(), stream.num_malformed


def _next_by_index(stream: IndexedStream, indices: Iterator[int]) -> tuple[Batch, dict, int]:
    """One of several workers of a random-access stream: the batch at its next index."""
    index = next(indices)
    return stream.batch_at(index), stream.state_at(index + 1), stream.num_malformed


def _ready(batch: Batch, pin: bool) -> Batch:
    """``batch`` as the training thread takes it: KJT key lengths counted on the host (~80 µs at batch 8192, off
    the training thread), pinned when asked."""
    batch = batch.with_host_key_lengths()
    return _pinned(batch) if pin else batch


def _put(out: queue.Queue, stop: threading.Event, item) -> None:
    while not stop.is_set():  # a bounded wait, so that close() is never stuck behind a full queue
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _pinned(batch: Batch) -> Batch:
    return Batch(
        dense=batch.dense.pin_memory(),
        sparse=batch.sparse.pin_memory(),
        labels=batch.labels.pin_memory(),
        sequences=None if batch.sequences is None else batch.sequences.pin_memory(),
    )
