"""The LoKA Probe's report as Dispatch reads it: each layer's forward MERE per backend.

``probe_stats`` names the report: the probe directory (``STATS_DIR``, holding ``report.json``) or the file itself.
A file that is not such a report is refused in one line before anything is measured.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

REPORT_FILE = "report.json"
TORCH_SAVE_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive, as the Probe's stats.pt is


def report_path(probe_stats: str) -> Path:
    """``STATS_DIR`` -> ``STATS_DIR/report.json``; a file path is the report itself."""
    path = Path(probe_stats)
    return path / REPORT_FILE if path.is_dir() else path


def existing_report(probe_stats: str) -> Path:
    """`report_path`, or a one-line ValueError when no such file exists or it is the Probe's statistics file
    (``stats.pt``, what the name ``probe_stats`` suggests, not the report made from it; read: its first bytes)."""
    path = report_path(probe_stats)
    make_one = f"run `python -m loka_trainer.probe.report STATS_DIR`, then name STATS_DIR or its {REPORT_FILE}"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist ({make_one})")
    try:
        with path.open("rb") as f:
            head = f.read(len(TORCH_SAVE_MAGIC))
    except OSError:
        return path  # read_probe_report names the error in its one line
    if head == TORCH_SAVE_MAGIC:
        raise ValueError(f"{str(path)!r} is the Probe's statistics, not its report ({make_one})")
    return path


class ReportedLayer(NamedTuple):
    """One layer of the report: its GEMM's K and N (in, out features) and backend -> forward MERE."""

    k: int
    n: int
    mere: dict[str, float]


def read_probe_report(probe_stats: str) -> dict[str, ReportedLayer]:
    """The report named by ``probe_stats`` -> FQN -> `ReportedLayer`.

    ValueError (one line, naming the file and what is wrong) when it is missing or not a LoKA Probe report."""
    path = existing_report(probe_stats)
    try:
        layers = json.loads(path.read_bytes())["layers"]
        if not isinstance(layers, dict):
            raise TypeError("'layers' is not a mapping")
        out = {str(fqn): ReportedLayer(int(entry["shape"]["K"]), int(entry["shape"]["N"]),
                                       {str(name): float(c["mere"]) for name, c in entry["candidates"].items()
                                        if c.get("mere") is not None})
               for fqn, entry in layers.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{str(path)!r} is not a LoKA Probe report ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]})") from None
    bad = [f"{fqn}/{name}" for fqn, layer in out.items() for name, m in layer.mere.items()
           if not (math.isfinite(m) and m >= 0)]
    if bad:
        raise ValueError(f"{str(path)!r} is not a LoKA Probe report: MERE not a finite number >= 0 at "
                         f"{', '.join(bad[:3])}")
    return out


def report_mismatch(reported: dict[str, ReportedLayer], targets: dict[str, tuple[int, int]]) -> str:
    """'' when the report fits the model whose Dispatch targets are ``targets`` (FQN -> (in, out features)): it
    names at least one target (when there is any) and each target it names has that shape; else what is wrong."""
    shared = sorted(reported.keys() & targets.keys())
    if targets and not shared:
        return (f"reports none of this model's {len(targets)} FP8 targets ({', '.join(sorted(targets)[:3])}, ...); "
                f"it reports {', '.join(sorted(reported)[:3]) or 'no layer'}")
    other = [f"{f} {reported[f].k}x{reported[f].n} vs {targets[f][0]}x{targets[f][1]}" for f in shared
             if (reported[f].k, reported[f].n) != targets[f]]
    if other:
        return f"reports {len(other)} layer(s) at another shape (report vs model, K x N): {', '.join(other[:3])}"
    return ""


def floor_mismatch(probe_stats: str, zero_floor: float) -> str:
    """'' when the report's MERE has Dispatch's denominator floor (``probe.mere``: ``--zero-floor`` in the report,
    ``mere_zero_floor`` in Dispatch; a report that does not record it is not compared), else what differs and the
    report command that matches. (The operand dtype may differ: FP8's error dwarfs BF16's rounding of its inputs.)"""
    made = json.loads(report_path(probe_stats).read_bytes()).get("zero_floor")
    if made is None or made == zero_floor:
        return ""
    return (f"was made with --zero-floor {made} but Dispatch measures with mere_zero_floor={zero_floor}, so its MERE "
            f"would not compare with the threshold as Dispatch's own: remake it with `python -m "
            f"loka_trainer.probe.report STATS_DIR --zero-floor {zero_floor}`")
