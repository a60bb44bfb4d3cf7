"""The LoKA Probe's report as Dispatch reads it: each layer's forward MERE per backend."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional


def read_probe_mere(stats_dir: Optional[str]) -> dict[str, dict[str, float]]:
    """LoKA Probe report (STATS_DIR/report.json) -> FQN -> backend -> forward MERE ({} when no dir)."""
    if stats_dir is None:
        return {}
    report = json.loads((Path(stats_dir) / "report.json").read_text())
    out: dict[str, dict[str, float]] = {}
    for fqn, entry in report.get("layers", {}).items():
        cands = entry.get("candidates", {})
        out[fqn] = {name: float(c["mere"]) for name, c in cands.items() if c.get("mere") is not None}
    return out
