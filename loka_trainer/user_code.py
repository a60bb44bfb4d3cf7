"""A user's function named on a command line as ``package.module:function`` (the probe report's ``--kernel``, the
Component Benchmark's ``bench.factory``): imported, or refused in one line saying why."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def import_callable(spec: str, *, option: str, expects: str) -> Callable[..., Any]:
    """``package.module:function`` (``function`` may be dotted: ``Class.method``) -> the callable.

    ``option`` names the command-line option in messages, ``expects`` what the callable must be. ValueError (one
    line) for a malformed spec, an import that fails (also inside the user's module), a missing attribute or a
    value that is not callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{option} {spec!r}: expected module:function (e.g. mypkg.models:build)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - ImportError or an error inside the user's module
        raise ValueError(f"{option} {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"{option} {spec!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{option} {spec!r}: {attr!r} is a {type(fn).__name__}, not {expects}")
    return fn


__all__ = ["import_callable"]
