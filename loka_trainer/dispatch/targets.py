"""Which ``nn.Linear``s Dispatch (and torchao's uniform recipes) may convert.

Targets: ``nn.Linear``s with K and N multiples of 16 and >= ``min_features``, never a 1-output prediction layer,
accepted by the optional ``module_filter_fn(module, fqn) -> bool``, and for torchao also with a real input row
count M % 16 == 0 (Dispatch checks M per backend and call). Embedding modules are TorchRec modules, not
``nn.Linear``, so they are never touched.
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from loka_trainer.dispatch.calibration import linear_input_rows

ModuleFilter = Callable[[nn.Module, str], bool]


def target_linears(model: nn.Module, *, min_features: int,
                   module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, nn.Linear]:
    """FQN -> nn.Linear for every Linear Dispatch / torchao may convert (see module docstring)."""
    out = {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        k, n = mod.in_features, mod.out_features
        if n == 1 or k % 16 or n % 16 or min(k, n) < min_features:
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        out[fqn] = mod
    return out


def drop_unaligned_rows(model: nn.Module, linears: dict[str, nn.Linear], batch,
                        log: Callable[[str], None]) -> dict[str, nn.Linear]:
    """``linears`` without those whose real input has a row count M not a multiple of 16 (e.g. attention
    queries computed from a few learned seeds): FP8 GEMMs need every dim % 16 (the weight grad contracts over
    M). Without a batch nothing is dropped."""
    if batch is None:
        return linears
    rows = linear_input_rows(model, linears, batch)
    dropped = sorted(f for f, ms in rows.items() if any(m % 16 for m in ms))
    if dropped:
        log(f"precision: {len(dropped)} Linear(s) stay high precision, input rows not a multiple of 16: "
            + ", ".join(f"{f} (M={sorted(rows[f])})" for f in dropped))
    return {f: m for f, m in linears.items() if f not in dropped}
