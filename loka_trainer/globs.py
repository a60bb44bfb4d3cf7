"""fnmatch globs a user names layers or modules with, and what to say when one names nothing (a typo would
otherwise select nothing, or exclude nothing, silently): ``precision.exclude``, ``callbacks.probe.include``,
``bench.include`` / ``bench.exclude``."""
from __future__ import annotations

import difflib
import fnmatch
from typing import Sequence


def unmatched(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    """The globs of ``patterns`` that match none of ``names`` (fnmatch, case-sensitive)."""
    return [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in names)]


def closest(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    """The names most like the ``patterns`` (up to 3 each, difflib), sorted: the ones a typo likely meant."""
    return sorted({n for p in patterns for n in difflib.get_close_matches(p, names, n=3, cutoff=0.5)})


def closest_or_examples(patterns: Sequence[str], names: Sequence[str], noun: str) -> str:
    """'closest of its N {noun}: [...]', 'none is close among its N {noun}, e.g. [the first 3]', or 'it has no
    {noun}'."""
    if not names:
        return f"it has no {noun}"
    near = closest(patterns, names)
    if near:
        return f"closest of its {len(names)} {noun}: {near}"
    return f"none is close among its {len(names)} {noun}, e.g. {list(names)[:3]}"
