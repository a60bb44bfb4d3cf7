"""The names (FQNs) LoKA gives a model's modules: the user's own, whatever wraps the model or a part of it.

``torch.compile``, TorchRec's DistributedModelParallel, activation checkpointing and FSDP1 hold the module they wrap
under an attribute of their own (``WRAPPER_COMPONENTS``), so ``model.named_modules()`` names a Linear of a compiled
submodule ``dense._orig_mod.0``. LoKA names it ``dense.0`` (``canonical_named_modules``) everywhere a layer is named:
Dispatch plans, ``exclude`` globs, ``loka_keep_bf16``, Probe statistics; a plan measured on a model with a compiled
part then applies to the same model compiled whole or not at all. DDP holds its module as ``module``, a name a
user's own module may have too: a component is left out only where its parent wraps the module under it
(`wrapped_attribute`), never by its name alone.
"""
from __future__ import annotations

from typing import Iterator, Optional

from torch import nn

# Wrapper attribute names that never belong to the user's model structure.
WRAPPER_COMPONENTS = ("_dmp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def wrapped_attribute(module: nn.Module) -> Optional[str]:
    """The attribute under which ``module`` holds the module it wraps: ``module`` of a ``DistributedDataParallel``,
    else its child named in ``WRAPPER_COMPONENTS``; None for a module of the user's model."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return "module"
    return next((name for name, _ in module.named_children() if name in WRAPPER_COMPONENTS), None)


def _canonical_walk(model: nn.Module, *, remove_duplicate: bool) -> Iterator[tuple[str, str, nn.Module, bool]]:
    """(``named_modules()``'s FQN, canonical FQN, module, whether it is a wrapper) for each module of ``model``, in
    ``named_modules()`` order: a component is left out where its parent holds the module it wraps under it."""
    names: dict[str, str] = {}  # named_modules' FQN -> canonical FQN, for each module met so far
    inner: dict[str, Optional[str]] = {}  # named_modules' FQN -> the attribute its module wraps a module under
    for fqn, module in model.named_modules(remove_duplicate=remove_duplicate):
        parent, _, leaf = fqn.rpartition(".")
        if not fqn or leaf == inner[parent]:
            names[fqn] = names.get(parent, "")
        else:
            names[fqn] = f"{names[parent]}.{leaf}" if names[parent] else leaf
        inner[fqn] = wrapped_attribute(module)
        yield fqn, names[fqn], module, inner[fqn] is not None


def canonical_named_modules(model: nn.Module, *, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` under canonical FQNs, a wrapper left out (the module it wraps comes under the same
    name next): the user's modules, in the same order. ``DDP(m)`` names ``m``'s modules as ``m`` does, a child of
    ``m`` named ``module`` included."""
    for _, name, module, wrapper in _canonical_walk(model, remove_duplicate=remove_duplicate):
        if not wrapper:
            yield name, module


def canonical_fqns(model: nn.Module) -> dict[str, str]:
    """``named_modules()``'s FQN of each module of ``model``, at every place it sits -> its canonical FQN
    ('dense._orig_mod.0' -> 'dense.0'): for a traversal of its own (torchao's module filters) that names modules
    as ``named_modules()`` does."""
    return {fqn: name for fqn, name, _, _ in _canonical_walk(model, remove_duplicate=False)}


def compiled_alone(model: nn.Module) -> list[str]:
    """Canonical FQNs of the modules of ``model`` that ``torch.compile`` wraps each on its own (the wrapper holds
    it as ``_orig_mod``): ``model.dense = torch.compile(model.dense)`` -> ['dense']. The compiled forward runs the
    module it was compiled with, so a module swapped in at that place would never run (one swapped in inside it
    does)."""
    return [name for _, name, module, _ in _canonical_walk(model, remove_duplicate=True)
            if "_orig_mod" in dict(module.named_children())]
