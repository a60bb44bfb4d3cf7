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


def feature_pair(value: str) -> tuple[int, int]:
    """A layer's (in, out) features written ``INxOUT`` or ``IN,OUT``, both >= 1."""
    parts = value.replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"not INxOUT (two positive integers): {value!r}")
    return int(parts[0]), int(parts[1])


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


def require_cuda(parser: argparse.ArgumentParser, *, what: str = "a CUDA GPU") -> None:
    """Exit with one ``error:`` line, status 2, when this machine has no CUDA device (a GPU benchmark's command
    line, checked after parsing and before anything runs)."""
    import torch  # noqa: PLC0415 -- lazy: the argument types need no torch

    if not torch.cuda.is_available():
        parser.exit(2, f"error: {parser.prog} needs {what} and none is available on this machine\n")


__all__ = ["feature_pair", "non_negative_int", "positive_int", "require_cuda", "writable_dir", "writable_file"]
