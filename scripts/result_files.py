"""A benchmark's result JSON, kept between calls so that a study resumes: read back with a clear refusal when
damaged (it holds earlier results, so it is neither used nor overwritten), written whole or not at all."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from loka_trainer.atomic_files import atomic_write_text


def json_object(path: Path, keys: Sequence[str] = ()) -> tuple[Optional[dict], Optional[str]]:
    """(the JSON object at ``path``, None), or (None, why it is not one with ``keys``, in a few words)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"not readable JSON ({exc})"
    if not isinstance(result, dict):
        return None, "not a JSON object"
    missing = [k for k in keys if k not in result]
    return (None, f"without {', '.join(missing)}") if missing else (result, None)


def previous_result(path: Path, *, keys: tuple[str, ...] = ()) -> Optional[dict]:
    """The JSON object an earlier call wrote at ``path`` (None when there is none). A file that is not JSON or not
    an object with ``keys``: one ``error:`` line and exit 2, the file left as it is."""
    if not path.exists():
        return None
    result, why = json_object(path, keys)
    if why is not None:
        print(f"error: {path} is damaged ({why}): it holds earlier results, so it is left as it is; move it away "
              f"to start afresh", file=sys.stderr)
        raise SystemExit(2)
    return result


def write_result(path: Path, result: Any) -> Path:
    """``result`` as indented JSON at ``path``, atomically."""
    return atomic_write_text(path, json.dumps(result, indent=2) + "\n")


__all__ = ["json_object", "previous_result", "write_result"]
