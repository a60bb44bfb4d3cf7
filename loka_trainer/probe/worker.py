"""One background thread that runs jobs in submission order and never loses their errors."""
from __future__ import annotations

import concurrent.futures
from typing import Callable


class SerialWorker:
    """Jobs run one at a time on a single thread. A job's exception is re-raised by ``wait()`` (or earlier by
    ``raise_finished_errors()``), never swallowed. ``close()`` waits for everything, then stops the thread."""

    def __init__(self, thread_name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._pending: list[concurrent.futures.Future] = []

    def run(self, job: Callable[[], object]) -> concurrent.futures.Future:
        # Forget jobs that finished cleanly; keep failed ones so their error surfaces in wait().
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        future = self._pool.submit(job)
        self._pending.append(future)
        return future

    def raise_finished_errors(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for future in done:
            future.result()

    def wait(self) -> None:
        """Block until every submitted job finished; re-raise the first error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
