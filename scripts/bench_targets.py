"""The speed targets of LoKA Dispatch's GPU benchmark, read off its result rows: one line each, met or not.

A target compares a variant against a reference (the fastest of one or more reference variants per shape) as
the geometric mean over the shapes where both were timed of reference µs / variant µs (GPU time from graph
replay, ``graph_us``), and is met when that ratio reaches ``at_least`` (or exceeds it, for ``strictly``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Target:
    suite: str
    variant: str
    references: tuple[str, ...]  # per shape, the fastest of these timed is the reference
    at_least: float
    what: str
    strictly: bool = False  # ratio > at_least instead of >=


TARGETS = (
    Target("mods_layer", "fused_best", ("base_eager",), 2.0,
           "fused Mods layer vs Linear(bias)+LayerNorm+SiLU BF16, figure-13 shapes, batch 1024"),
    Target("mods_layer", "fused_best", ("mods_compiled",), 1.0, "fused Mods layer vs the Mods in PyTorch compiled",
           strictly=True),
    Target("wukong", "loka_compiled", ("torchao_tensorwise_compiled", "torchao_rowwise_compiled",
                                       "torchao_rowwise_with_gw_hp_compiled"), 1.05,
           "Wukong dense arch, LoKA vs the best uniform torchao recipe (compiled)"),
    Target("wukong", "loka_compiled", ("bf16_compiled",), 1.15, "Wukong dense arch, LoKA vs BF16 (compiled)"),
)


def target_ratio(rows: list[dict], target: Target) -> tuple[Optional[float], int]:
    """(geomean of reference µs / variant µs over the shapes with both timed, or None; that number of shapes)."""
    times: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("suite") == target.suite and r.get("graph_us"):
            times.setdefault((r["M"], r["K"], r["N"]), {})[r["variant"]] = r["graph_us"]
    logs = []
    for by_variant in times.values():
        refs = [by_variant[v] for v in target.references if v in by_variant]
        if refs and target.variant in by_variant:
            logs.append(math.log(min(refs) / by_variant[target.variant]))
    return (math.exp(sum(logs) / len(logs)) if logs else None), len(logs)


def target_lines(rows: list[dict], targets=TARGETS) -> list[str]:
    """One line per target whose suite was run: the ratio, the bar, and MET / NOT MET."""
    lines = []
    for t in targets:
        ratio, shapes = target_ratio(rows, t)
        if ratio is None:
            continue
        met = ratio > t.at_least if t.strictly else ratio >= t.at_least
        bar = f"{'>' if t.strictly else '>='} {t.at_least:.2f}x"
        lines.append(f"target: {t.what}: {ratio:.2f}x over {shapes} shape(s) (needs {bar}): "
                     f"{'MET' if met else 'NOT MET'}")
    return lines
