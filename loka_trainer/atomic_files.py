"""Files that appear whole or not at all: written to a temporary file in the same folder, flushed to disk, then
renamed over the destination (``os.replace`` is atomic on one file system). A process killed while writing leaves
the previous file (or none) and no partial one: the run's records, plans, statistics and checkpoint markers are
read back by later runs, which must not find half a file. Hand-written: the standard library has no such call."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> Path:
    """Create or replace ``path`` with what ``write(file)`` writes into a binary file (parents made as needed);
    on any failure the temporary file is removed and ``path`` is untouched. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; these files are read by the team and by later runs
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """``atomic_write`` of ``text`` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def atomic_copy(source: Path, path: Path) -> Path:
    """``atomic_write`` of ``source``'s bytes."""
    with open(source, "rb") as src:
        return atomic_write(path, lambda f: shutil.copyfileobj(src, f))


__all__ = ["atomic_copy", "atomic_write", "atomic_write_text"]
