"""loka_trainer: FP8 training for large recommendation models (LoKA Probe, Mods, Dispatch) and a Component Benchmark.

The public API, in the manner of torchao's ``convert_to_float8_training``::

    from loka_trainer import LoKAConfig, apply_mods, convert_to_loka, register_weight_cache_hook

    apply_mods(model)                      # Linear -> norm -> activation blocks become the Mods (before training)
    plan = convert_to_loka(model, LoKAConfig(), calibration_batch=batch)   # Mods fusion + Dispatch
    optimizer = torch.optim.AdamW(model.parameters())
    register_weight_cache_hook(model, optimizer)   # FP8 weight casts reused until each optimizer step

``ProbeCallback`` (with ``TrainState``) collects the LoKA Probe's statistics during training; ``run_bench``,
``BenchOptions``, ``ModuleProvider`` and ``write_results`` are the Component Benchmark's entry.

Names load on first use: ``import loka_trainer`` imports neither torch's extensions nor triton.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS = {
    "LoKAConfig": "loka_trainer.dispatch.config",
    "DispatchPlan": "loka_trainer.dispatch.plan",
    "convert_to_loka": "loka_trainer.dispatch.convert",
    "apply_mods": "loka_trainer.mods.transform",
    "register_weight_cache_hook": "loka_trainer.kernels.linear",
    "ProbeCallback": "loka_trainer.callbacks.probe",
    "TrainState": "loka_trainer.callbacks.base",
    "run_bench": "loka_trainer.bench",
    "BenchOptions": "loka_trainer.bench",
    "ModuleProvider": "loka_trainer.bench",
    "write_results": "loka_trainer.bench",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loka_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
