"""Which Linears the probe observes, and the layer names (FQNs) that stats files and reports use.

A layer has the same name with or without TorchRec's DistributedModelParallel, torch.compile, activation
checkpointing or DDP around the model or a part of it: the name Dispatch gives it
(``module_names.canonical_named_modules``), which it maps report entries back onto.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Optional, Sequence

from torch import nn

from loka_trainer.mods.module import FusedLinearMods
from loka_trainer.module_names import canonical_named_modules

ModuleFilter = Callable[[nn.Module, str], bool]

LINEAR_TYPES = (nn.Linear, FusedLinearMods)  # a module with weight (N, K) applied as x·Wᵀ to its input x (..., K)


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def select_linears(model: nn.Module, *, include: Optional[Sequence[str]] = None,
                   exclude: Optional[Sequence[str]] = None, module_types: Optional[Sequence[str]] = None,
                   min_features: int = 1, module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, nn.Module]:
    """Target layers keyed by canonical FQN (``module_names.canonical_named_modules``).

    A module qualifies when it is an nn.Linear (any subclass: torchao Float8Linear, LoKALinear) or a LoKA
    ``FusedLinearMods`` (the Linear of a fused Mods block, under that Linear's FQN), its class or a
    base class is named in ``module_types`` (if given), its FQN matches an ``include`` glob (if given) and
    no ``exclude`` glob, both in_features and out_features are >= ``min_features``, and
    ``module_filter_fn(module, fqn)`` (if given) is true.
    """
    targets: dict[str, nn.Module] = {}
    for fqn, module in canonical_named_modules(model):
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
