"""The names (FQNs) LoKA gives a model's modules: the user's own, whatever wraps the model or a part of it.

``torch.compile``, TorchRec's DistributedModelParallel, activation checkpointing and FSDP1 hold the module they wrap
under an attribute of their own (``WRAPPER_COMPONENTS``), so ``model.named_modules()`` names a Linear of a compiled
submodule ``dense._orig_mod.0``. LoKA names it ``dense.0`` (``canonical_fqn``) everywhere a layer is named: Dispatch
plans, ``exclude`` globs, ``loka_keep_bf16``, Probe statistics; a plan measured on a model with a compiled part then
applies to the same model compiled whole or not at all.
"""
from __future__ import annotations

from typing import Iterator

from torch import nn

# Wrapper attribute names that never belong to the user's model structure.
WRAPPER_COMPONENTS = ("_dmp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_fqn(fqn: str) -> str:
    """``fqn`` without its wrapper components, wherever they are nested: 'dense._orig_mod.0' -> 'dense.0'."""
    return ".".join(p for p in fqn.split(".") if p and p not in WRAPPER_COMPONENTS)


def wraps(module: nn.Module) -> bool:
    """Whether ``module`` is a wrapper: it holds the module it wraps under one of ``WRAPPER_COMPONENTS``."""
    return any(name in WRAPPER_COMPONENTS for name, _ in module.named_children())


def canonical_named_modules(model: nn.Module, *, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` under canonical FQNs, a wrapper left out (the module it wraps comes under the same
    name next): the user's modules, in the same order."""
    for fqn, module in model.named_modules(remove_duplicate=remove_duplicate):
        if not wraps(module):
            yield canonical_fqn(fqn), module


def compiled_alone(model: nn.Module) -> list[str]:
    """Canonical FQNs of the modules of ``model`` that ``torch.compile`` wraps each on its own (the wrapper holds
    it as ``_orig_mod``): ``model.dense = torch.compile(model.dense)`` -> ['dense']. The compiled forward runs the
    module it was compiled with, so a module swapped in at that place would never run (one swapped in inside it
    does)."""
    return [canonical_fqn(fqn) for fqn, m in model.named_modules() if "_orig_mod" in dict(m.named_children())]
