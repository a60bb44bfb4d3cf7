"""Where a result came from, written into every benchmark's JSON by the benchmark itself: the date, the commit (and
whether tracked files differed from it), a digest of the code that ran, the device, torch and triton versions, and
the command that reproduces it.

    {"date": "2026-12-02", "commit": "dead217", "dirty": false, "source": "3f09a1c2b7de", "device": "NVIDIA H200",
     "torch": "2.11.0+cu130", "triton": "3.6.0", "command": "python -m scripts.bench_user_path OUT"}

``source`` names the code itself (``train.py`` and the package), so a result from a copy whose git metadata is
missing or stale still says what ran: ``python -m scripts.provenance`` prints it for a checkout, to compare.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_state(root: Path = ROOT) -> tuple[Optional[str], Optional[bool]]:
    """(short commit of HEAD, whether tracked files differ from it), or (None, None) outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short=7", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None, None


# the code a result depends on: train.py and the package's sources and configs
SOURCE_FILES = ("train.py", "loka_trainer/**/*.py", "loka_trainer/**/*.yaml")


def source_digest(root: Path = ROOT) -> str:
    """12 hex digits of sha256 over ``SOURCE_FILES`` under ``root`` (relative path and bytes of each, sorted):
    equal for two copies of the same code, whatever their git state."""
    digest = hashlib.sha256()
    paths = sorted({p for pattern in SOURCE_FILES for p in root.glob(pattern) if p.is_file()})
    for path in paths:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def command_line(argv: list[str], root: Path = ROOT) -> str:
    """The command as a user types it: a script of this repository run as a module (``python -m scripts.x``)
    is written that way; anything else as ``python`` + argv."""
    script = Path(argv[0]).resolve() if argv and argv[0].endswith(".py") else None
    if script is not None and script.is_relative_to(root):
        module = ".".join(script.relative_to(root).with_suffix("").parts)
        return " ".join(["python", "-m", module, *argv[1:]])
    return " ".join(["python", *argv])


def device_name() -> str:
    """The first CUDA device's name, else the CPU's (``platform.processor()``, or ``cpu``)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return platform.processor() or "cpu"


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(argv: Optional[list[str]] = None) -> dict:
    """The fields above for this process (``argv`` default ``sys.argv``)."""
    commit, dirty = git_state()
    return {"date": datetime.date.today().isoformat(), "commit": commit, "dirty": dirty, "source": source_digest(),
            "device": device_name(), "torch": torch.__version__, "triton": _version("triton"),
            "command": command_line(sys.argv if argv is None else argv)}


def main(argv: Optional[list[str]] = None) -> None:
    """Print ``source_digest()`` of this checkout (``--help``: the usage, nothing else)."""
    argparse.ArgumentParser(prog="python -m scripts.provenance", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(source_digest())


if __name__ == "__main__":
    main()
