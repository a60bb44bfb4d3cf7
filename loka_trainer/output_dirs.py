"""Whether a run can write where it is told to, checked before it starts (leaving nothing behind), and the lock
that keeps a second run out of a run directory in use."""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import Optional


def unwritable_reason(path: Path) -> Optional[str]:
    """None when ``path`` is a writable directory or can be made one; else why not, in a few words.

    Writable means a file can be created in ``path``'s nearest existing ancestor: one empty probe file is created
    there and removed at once. Permission bits alone pass ``/proc`` and, for root, any read-only directory."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return file_creation_failure(existing)


def file_creation_failure(directory: Path) -> Optional[str]:
    """None when an empty file can be created in the existing ``directory`` (it is removed at once); else why not."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".loka-write-check-")
    except OSError as exc:
        return f"cannot create a file in {directory}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(probe)
    return None


class RunDirInUse(Exception):
    """Another process holds the run directory's lock."""


class RunDirLock:
    """An exclusive ``flock`` on the directory ``run_dir`` itself (created if missing; no file is added), held while
    this object lives: a second run started on the same directory (a requeued job while the first is still
    ending) gets ``RunDirInUse`` instead of writing the same checkpoints and metrics. The kernel drops it when the
    process ends, however it ends."""

    def __init__(self, run_dir: Path) -> None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._fd: Optional[int] = os.open(run_dir, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise RunDirInUse(f"{run_dir} is in use by another run (its lock is held); wait for it to end or give "
                              f"this run another hydra.run.dir") from None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)


__all__ = ["RunDirInUse", "RunDirLock", "unwritable_reason"]
