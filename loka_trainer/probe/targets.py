"""Which Linears the probe observes, and the layer names (FQNs) that stats files and reports use.

FQNs are cleaned of wrapper components so that the same layer has the same name with or without TorchRec's
DistributedModelParallel, torch.compile, activation checkpointing or DDP: the names Dispatch gives the layers
(``module_names.canonical_fqn``; ``convert_to_loka`` converts a DDP model inside its wrapper), which it maps report
entries back onto.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Optional, Sequence

from torch import nn

from loka_trainer.mods.module import FusedLinearMods
from loka_trainer.module_names import canonical_fqn

ModuleFilter = Callable[[nn.Module, str], bool]

LINEAR_TYPES = (nn.Linear, FusedLinearMods)  # a module with weight (N, K) applied as x·Wᵀ to its input x (..., K)


def clean_fqn(fqn: str) -> str:
    """'_dmp_wrapped_module.dense._orig_mod.0' -> 'dense.0' (``canonical_fqn``); a leading DDP 'module.' is dropped
    too."""
    parts = canonical_fqn(fqn).split(".")
    if parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def select_linears(model: nn.Module, *, include: Optional[Sequence[str]] = None,
                   exclude: Optional[Sequence[str]] = None, module_types: Optional[Sequence[str]] = None,
                   min_features: int = 1, module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, nn.Module]:
    """Target layers keyed by clean FQN.

    A module qualifies when it is an nn.Linear (any subclass: torchao Float8Linear, LoKALinear) or a LoKA
    ``FusedLinearMods`` (the Linear of a fused Mods block, under that Linear's FQN), its class or a
    base class is named in ``module_types`` (if given), its clean FQN matches an ``include`` glob (if given) and
    no ``exclude`` glob, both in_features and out_features are >= ``min_features``, and
    ``module_filter_fn(module, fqn)`` (if given) is true.
    """
    targets: dict[str, nn.Module] = {}
    for raw_fqn, module in model.named_modules():
        fqn = clean_fqn(raw_fqn)
        if not isinstance(module, LINEAR_TYPES) or fqn in targets:
            continue
        if module_types and not (_class_names(module) & set(module_types)):
            continue
        if include and not any(fnmatch.fnmatchcase(fqn, pat) for pat in include):
            continue
        if exclude and any(fnmatch.fnmatchcase(fqn, pat) for pat in exclude):
            continue
        if min(module.in_features, module.out_features) < min_features:
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        targets[fqn] = module
    return targets
