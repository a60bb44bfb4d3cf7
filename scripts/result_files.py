"""A benchmark's result JSON, kept between calls so that a study resumes: read back with a clear refusal when
damaged (it holds earlier results, so it is neither used nor overwritten), written whole or not at all."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

from loka_trainer.atomic_files import atomic_write_text


def previous_result(path: Path, *, keys: tuple[str, ...] = ()) -> Optional[dict]:
    """The JSON object an earlier call wrote at ``path`` (None when there is none). A file that is not JSON or not
    an object with ``keys``: one ``error:`` line and exit 2, the file left as it is."""
    if not path.exists():
        return None
    try:
        result = json.loads(path.read_text())
        missing = [k for k in keys if k not in result] if isinstance(result, dict) else ["a JSON object"]
    except (OSError, ValueError) as exc:
        missing, result = [f"readable JSON ({exc})"], None
    if missing:
        print(f"error: {path} is damaged (not {', '.join(missing)}): it holds earlier results, so it is left as "
              f"it is; move it away to start afresh", file=sys.stderr)
        raise SystemExit(2)
    return result


def write_result(path: Path, result: Any) -> Path:
    """``result`` as indented JSON at ``path``, atomically."""
    return atomic_write_text(path, json.dumps(result, indent=2) + "\n")


__all__ = ["previous_result", "write_result"]
