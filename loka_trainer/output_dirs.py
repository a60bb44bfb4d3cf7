"""Whether a run can write where it is told to, checked before it starts (creating nothing)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def unwritable_reason(path: Path) -> Optional[str]:
    """None when ``path`` is a writable directory or can be made one (its nearest existing ancestor is a writable
    directory); else why not, in a few words. Reads only."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


__all__ = ["unwritable_reason"]
