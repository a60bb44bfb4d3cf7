"""Take a PNG screenshot of an icicle HTML (or any local HTML) with headless Chromium, offline.

    python -m scripts.screenshot_icicle DIR/bench_icicle.html [--out shot.png] [--size 1400,900]

Assumes Debian's ``chromium`` (``apt-get install -y chromium``); every network feature is switched off, so a
chart that renders here needs nothing beyond the HTML file itself. Exits 2 when Chromium is absent.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from loka_trainer.arg_types import writable_file

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=5000")


def existing_file(value: str) -> Path:
    """An input file that exists (argparse type)."""
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{value} is a directory, not a file" if path.is_dir() else
                                         f"{value}: file not found")
    return path


def window_size(value: str) -> str:
    """A window size ``W,H`` (or ``WxH``), both positive integers; returned as Chromium's ``W,H`` (argparse type)."""
    parts = value.replace("x", ",").split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"not W,H (two positive integers): {value!r}")
    return f"{int(parts[0])},{int(parts[1])}"


def find_chromium() -> Optional[str]:
    """Path of a Chromium binary, or None."""
    for cand in CHROMIUM_CANDIDATES:
        path = shutil.which(cand)
        if path:
            return path
    return None


def screenshot(html: Path, png: Path, *, size: str = "1400,900", timeout_s: float = 120.0) -> Path:
    """Render ``html`` in headless Chromium and write ``png``; raises RuntimeError when ``html`` is missing or
    Chromium is missing/fails."""
    if not html.is_file():
        raise RuntimeError(f"{html}: file not found")
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError("chromium not found; install it with: apt-get install -y chromium")
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={png.resolve()}",
               f"--window-size={size}", html.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if not png.exists():
        raise RuntimeError(f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return png


def dump_dom(html: Path, *, timeout_s: float = 120.0) -> str:
    """The DOM after scripts ran (``--dump-dom``), to check what a page rendered."""
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError("chromium not found; install it with: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", html.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    return proc.stdout


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.screenshot_icicle", description=__doc__.splitlines()[0])
    parser.add_argument("html", type=existing_file)
    parser.add_argument("--out", type=writable_file, default=None, help="PNG path (default: next to the HTML)")
    parser.add_argument("--size", type=window_size, default="1400,900", help="window size W,H")
    args = parser.parse_args(argv)
    out = args.out or args.html.with_suffix(".png")
    try:
        print(screenshot(args.html, out, size=args.size))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
