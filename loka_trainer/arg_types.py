"""``argparse`` types shared by the command-line tools: a bad value is argparse's one-line error when the command
line is parsed, not a traceback after the first run or result."""
from __future__ import annotations

import argparse
from pathlib import Path

from loka_trainer.output_dirs import unwritable_reason


def writable_dir(value: str) -> Path:
    """An output folder that exists and is writable or can be created there (nothing is created now)."""
    if (reason := unwritable_reason(Path(value))) is not None:
        raise argparse.ArgumentTypeError(f"cannot write to {value} ({reason})")
    return Path(value)


def writable_file(value: str) -> Path:
    """An output file: not a folder, in a folder that is writable or can be created (nothing is created now)."""
    path = Path(value)
    reason = f"{value} is a directory" if path.is_dir() else unwritable_reason(path.parent)
    if reason is not None:
        raise argparse.ArgumentTypeError(f"cannot write to {value} ({reason})")
    return path


def _int_at_least(low: int, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {number}")
    return number


def positive_int(value: str) -> int:
    """An integer >= 1 (a count of runs, ranks, steps, batches)."""
    return _int_at_least(1, value)


def non_negative_int(value: str) -> int:
    """An integer >= 0 (a warm-up length, an interval where 0 means off)."""
    return _int_at_least(0, value)


__all__ = ["non_negative_int", "positive_int", "writable_dir", "writable_file"]
