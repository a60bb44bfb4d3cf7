"""Statistics files: atomic write, a background saver, and a validating loader.

File layout (``STATS_DIR/stats.pt``, torch.save of plain dicts and tensors, loadable with weights_only=True)::

    {"version": 2, "step": int, "world_size": int, "sha256": str,
     "layers": {fqn: {"in_features": I, "out_features": O, "has_bias": bool,
                      "activation": {"count": (), "mean": (I,), "scatter": (G, Kb, Kb), "max_abs": (I,),
                                     "representation": str, "rows_per_call": int, "calls": int},
                      "weight": {"count": int, "mean": (O, I), "u": (O, O)|(O,), "v": (I, I)|(I,),
                                 "momentum": float, "representation": str}}}}

``sha256`` is ``payload_digest`` of everything else (every tensor's dtype, shape and bytes, every other value,
in key order): a file whose content changed after the write (flipped bits, a partial copy that still unpickles)
is rejected on load. Version 2: the weight statistics describe the deviation around the running mean
(``probe.weight``) and the file carries the checksum; files of another version are rejected.

Atomicity: write to a temporary file in the same directory, fsync, then os.replace (atomic on POSIX), so a
crash mid-write leaves the previous file intact and loadable.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from loka_trainer.atomic_files import atomic_write
from loka_trainer.probe.worker import SerialWorker

STATS_VERSION = 2
STATS_FILE = "stats.pt"
CHECKSUM_KEY = "sha256"


def _feed(h: Any, obj: Any) -> None:
    """Hash obj's content: tensors by dtype, shape and bytes; containers in key order; scalars by type and repr."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"dict:{len(obj)}:".encode())
        for key in sorted(obj, key=repr):
            h.update(f"{key!r}=".encode())
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}:{len(obj)}:".encode())
        for item in obj:
            _feed(h, item)
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def payload_digest(stats: dict) -> str:
    """sha256 hex digest of a stats dict's content, the checksum entry itself excluded."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in stats.items() if k != CHECKSUM_KEY})
    return h.hexdigest()


def seal_stats(stats: dict) -> dict:
    """stats plus its checksum entry (call on the CPU copy that will be written; runs on the saver thread)."""
    return {**stats, CHECKSUM_KEY: payload_digest(stats)}


def to_cpu(obj: Any) -> Any:
    """Recursively move tensors in dicts/lists to CPU (a copy, so later in-place updates do not leak in)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def atomic_save(obj: Any, path: Path, *, writer: Callable[[Any, Any], None] = torch.save) -> None:
    """Write obj to path whole or not at all (``atomic_files.atomic_write``). ``writer(obj, file)`` is injectable
    for tests."""
    atomic_write(Path(path), lambda f: writer(obj, f))


class AsyncSaver(SerialWorker):
    """Serializes and writes snapshots on one background thread, in submission order.

    NOTE: the caller passes a snapshot it will not mutate (see to_cpu); the step loop only pays for that copy.
    A failed write is re-raised on the next submit() or wait(), so errors are not lost.
    """

    def __init__(self, *, writer: Callable[[Any, Any], None] = torch.save):
        super().__init__("probe-save")
        self._writer = writer

    def submit(self, snapshot_fn: Callable[[], Any], path: Path) -> concurrent.futures.Future:
        """Run ``atomic_save(snapshot_fn(), path)`` in the background; snapshot_fn runs there too."""
        self.raise_finished_errors()
        return self.run(lambda: atomic_save(snapshot_fn(), path, writer=self._writer))


def _check(cond: bool, path: Path, reason: str) -> None:
    if not cond:
        raise ValueError(f"invalid probe stats file {path}: {reason}")


def _finite(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and bool(torch.isfinite(t).all())


def _validate_layer(path: Path, fqn: str, layer: dict) -> None:
    for key in ("in_features", "out_features", "activation", "weight"):
        _check(key in layer, path, f"layer {fqn!r} lacks {key!r}")
    num_in, num_out = layer["in_features"], layer["out_features"]
    act, weight = layer["activation"], layer["weight"]
    for key in ("count", "mean", "scatter", "max_abs"):
        _check(_finite(act.get(key)), path, f"layer {fqn!r} activation {key!r} missing or not finite")
    _check(tuple(act["mean"].shape) == (num_in,), path, f"layer {fqn!r} activation mean is not ({num_in},)")
    scatter = act["scatter"]
    _check(scatter.ndim == 3 and scatter.shape[1] == scatter.shape[2]
           and scatter.shape[0] == math.ceil(num_in / scatter.shape[1]), path,
           f"layer {fqn!r} activation scatter {tuple(scatter.shape)} does not cover {num_in} features")
    _check(float(act["count"]) > 1, path, f"layer {fqn!r} has {float(act['count']):g} activation rows (need > 1)")
    _check(int(weight.get("count", 0)) > 0, path, f"layer {fqn!r} has no weight observation")
    for key in ("mean", "u", "v"):
        _check(_finite(weight.get(key)), path, f"layer {fqn!r} weight {key!r} missing or not finite")
    _check(tuple(weight["mean"].shape) == (num_out, num_in), path, f"layer {fqn!r} weight mean is not ({num_out}, {num_in})")
    _check(weight["u"].shape[0] == num_out and weight["v"].shape[0] == num_in, path,
           f"layer {fqn!r} weight factors do not match ({num_out}, {num_in})")


def load_stats(path: Path, *, map_location: str = "cpu") -> dict:
    """Load and validate a stats file (or STATS_DIR containing stats.pt). Bad file -> one-line ValueError."""
    path = Path(path)
    if path.is_dir():
        path = path / STATS_FILE
    _check(path.is_file(), path, "file not found")
    try:
        stats = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad file for the user
        first_line = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise ValueError(f"invalid probe stats file {path}: cannot be read ({type(exc).__name__}: {first_line})") \
            from None
    _check(isinstance(stats, dict), path, "not a dict")
    _check(stats.get("version") == STATS_VERSION, path,
           f"version {stats.get('version')!r}, this code reads version {STATS_VERSION} (re-run the probe)")
    _check(isinstance(stats.get(CHECKSUM_KEY), str), path, "no checksum")
    _check(stats[CHECKSUM_KEY] == payload_digest(stats), path, "checksum mismatch: the content changed after it "
           "was written (damaged file)")
    _check(isinstance(stats.get("layers"), dict) and len(stats["layers"]) > 0, path, "no layers")
    for fqn, layer in stats["layers"].items():
        _validate_layer(path, fqn, layer)
    return stats


def latest_stats_path(stats_dir: Path) -> Optional[Path]:
    path = Path(stats_dir) / STATS_FILE
    return path if path.is_file() else None
