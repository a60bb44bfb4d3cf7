"""``PrefetchStream``: produce the next batches of a train stream on a background thread.

Why: generating or parsing a batch costs milliseconds of CPU that would otherwise sit on the training step's
critical path (and distort step-time ratios measured on the GPU). Torch ops release the GIL, so one thread
overlaps generation with the step (a random-access stream can instead be made by worker processes:
``worker_processes.py``). The position stays exact: every queued batch carries the state of the
underlying stream right after it was produced, and ``state_dict`` returns the state after the last batch
*consumed*, so a checkpoint never skips the batches still in the queue.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Optional

from loka_trainer.data.base import BatchStream
from loka_trainer.data.batch import Batch

# Streams whose worker runs. A daemon thread still inside a torch op when the interpreter finalizes aborts the
# process ("terminate called without an active exception", exit 134), so the workers are stopped at exit.
_RUNNING: "weakref.WeakSet[PrefetchStream]" = weakref.WeakSet()


class PrefetchStream(BatchStream):
    """Wraps an infinite ``BatchStream``; ``depth`` batches are kept ready. ``pin_memory`` for async H2D copies."""

    def __init__(self, stream: BatchStream, *, depth: int = 2, pin_memory: bool = False) -> None:
        if stream.num_batches is not None:
            raise ValueError("PrefetchStream wraps infinite (train) streams only; eval streams restart on iter()")
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._stream, self._depth, self._pin = stream, depth, pin_memory
        self._state = stream.state_dict()
        self._malformed = stream.num_malformed
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()  # replaced per worker, so a stopped worker never sees a cleared event

    @property
    def num_malformed(self) -> int:
        """Malformed rows the wrapped stream had met when it produced the last batch consumed: rows the worker
        skipped further ahead are not counted yet, so the count does not depend on ``depth``."""
        return self._malformed

    def __next__(self) -> Batch:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            # Every batch produced before the error was consumed, so the wrapped stream is where the error left
            # it, exactly as without prefetching; the worker has exited.
            self._stop_worker()
            raise item
        batch, self._state, self._malformed = item
        return batch

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._depth)
        # NOTE: the worker gets its inputs, not ``self``: a thread holding ``self`` would keep an abandoned
        # stream (and its thread) alive forever; this way ``__del__`` can stop it.
        args = (self._stream, self._queue, self._stop, self._pin)
        self._thread = threading.Thread(target=_work, args=args, name="loka-data-prefetch", daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def _stop_worker(self) -> bool:
        if self._thread is None:
            return False
        self._stop.set()
        self._thread.join()
        self._thread = None
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
        if getattr(self, "_thread", None) is not None:  # __init__ may have raised before setting it
            self._stop_worker()


@atexit.register
def _stop_running_workers() -> None:
    for stream in list(_RUNNING):
        stream._stop_worker()


def _work(stream: BatchStream, out: queue.Queue, stop: threading.Event, pin: bool) -> None:
    """Worker loop: (batch, state and malformed count of ``stream`` right after it) into ``out`` until ``stop``;
    errors go in too."""
    try:
        while not stop.is_set():
            batch = next(stream).with_host_key_lengths()  # ~80 µs at batch 8192: not on the training thread
            if pin:
                batch = batch.pin_memory()
            _put(out, stop, (batch, stream.state_dict(), stream.num_malformed))
    except BaseException as err:  # handed to the consumer, which re-raises it on its own thread
        _put(out, stop, err)


def _put(out: queue.Queue, stop: threading.Event, item) -> None:
    while not stop.is_set():  # a bounded wait, so that close() is never stuck behind a full queue
        try:
            out.put(item, timeout=0.1)
            return
        except queue.Full:
            continue

