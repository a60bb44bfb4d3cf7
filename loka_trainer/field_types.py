"""Type checks for the fields of the public config dataclasses (``LoKAConfig``, ``ProbeConfig``,
``BenchOptions``), which a user's Python code fills in directly: Hydra checks its own, but ``exclude="2*"`` from
Python would be read as the globs '2' and '*', and ``mere_threshold="0.1"`` would fail later in a comparison that
does not name the field.

Annotations are read as the dataclass declares them (strings, under ``from __future__ import annotations``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(item, str) for item in v)


# annotation -> (check, what a value must be, for the message)
FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "Optional[str]": (lambda v: v is None or isinstance(v, (str, os.PathLike)), "a path or None"),
    "Optional[List[str]]": (lambda v: v is None or _is_str_list(v), "a list of strings or None"),
    "tuple[str, ...]": (_is_str_list, "a list of strings"),
}
LIST_TYPES = ("Optional[List[str]]", "tuple[str, ...]")


def field_type_problem(config: Any, where: str) -> Optional[str]:
    """The first field of dataclass ``config`` whose value does not fit its annotation, as one line
    ('LoKAConfig.exclude: must be a list of strings or None, got str '2*' (a list: ['2*'])'), else None. Fields
    of other annotations are not checked."""
    for field in dataclasses.fields(config):
        check = FIELD_TYPES.get(str(field.type))
        value = getattr(config, field.name)
        if check is not None and not check[0](value):
            hint = f" (a list: [{value!r}])" if isinstance(value, str) and str(field.type) in LIST_TYPES else ""
            return f"{where}.{field.name}: must be {check[1]}, got {type(value).__name__} {value!r}{hint}"
    return None


def dotted(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as one level with dotted keys: {"model": {"mods": {"norm": None}}} -> {"model.mods.norm":
    None} (what a resume compares and a data stream records)."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        flat.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat
