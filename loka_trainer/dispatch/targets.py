"""Which ``nn.Linear``s Dispatch (and torchao's uniform recipes) may convert.

Targets: ``nn.Linear``s with K and N multiples of 16 and >= ``min_features``, never a 1-output prediction layer,
accepted by the optional ``module_filter_fn(module, fqn) -> bool``, none whose FQN matches one of the config's
``exclude`` globs (``configured_targets``), and for torchao also with a real input row count M % 16 == 0
(Dispatch checks M per backend and call). Embedding modules are TorchRec modules, not ``nn.Linear``, so they are
never touched. A parametrized Linear (``torch.nn.utils.parametrize``: weight norm, spectral norm, ...) stays BF16:
its ``weight`` is computed from other Parameters at each call, and a swap that takes ``linear.weight`` would keep
that one computed tensor as a constant (trained no more, gone from the state_dict). A Linear that ``torch.compile``
wraps on its own (``model.head = torch.compile(model.head)``) stays BF16 too: the compiled forward runs the module
it was compiled with, never one swapped in under the wrapper (compile its parent instead).

Layers are named by their canonical FQNs (``module_names``): a compiled or wrapped part of the model adds no
``_orig_mod`` to them, so ``exclude`` globs, ``module_filter_fn`` and plans see the model's own names.

A module may name Linears of its own that Dispatch must keep BF16, in a class attribute ``loka_keep_bf16``: a
tuple of fnmatch globs relative to the module (``declared_bf16``): what its author measured FP8 to harm and no
per-GEMM error shows (the zoo's InterFormer: its personalised FFN's weight generator). ``keep_declared_bf16`` in
the config turns this off; torchao's uniform recipes do not read it (they are the baselines as torchao applies
them).
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Optional, Sequence

from torch import nn
from torch.nn.utils import parametrize

from loka_trainer.dispatch.calibration import linear_input_rows
from loka_trainer.globs import closest_or_examples, unmatched
from loka_trainer.module_names import canonical_named_modules, compiled_alone

ModuleFilter = Callable[[nn.Module, str], bool]


def excluded(fqn: str, exclude: Optional[Sequence[str]]) -> bool:
    """Whether ``fqn`` matches one of the ``exclude`` globs (fnmatch, case-sensitive)."""
    return any(fnmatch.fnmatchcase(fqn, pattern) for pattern in exclude or ())


def check_exclude(exclude: Optional[Sequence[str]], targets: Sequence[str], *, where: str) -> None:
    """One-line ValueError for an ``exclude`` glob that matches none of ``targets`` (the FQNs of the Linears that
    would be converted without it): a typo would otherwise leave the layer in FP8 silently."""
    typos = unmatched(exclude or (), targets)
    if typos:  # the closest names, not all of them: a GPU-scale InterFormer has 64 targets
        raise ValueError(f"{where}.exclude: {typos} name(s) no FP8 target of this model; "
                         + closest_or_examples(typos, sorted(targets), "targets"))


KEEP_BF16_ATTR = "loka_keep_bf16"


def declared_bf16(model: nn.Module) -> list[str]:
    """FQNs of the Linears of ``model`` that a module of it names in its ``loka_keep_bf16`` globs (relative to
    that module), sorted. A ``loka_keep_bf16`` that is not a tuple of strings, or a glob of it that names none of
    its module's Linears (a typo would leave the layer to Dispatch silently) -> one-line ValueError."""
    linears = [fqn for fqn, m in canonical_named_modules(model) if isinstance(m, nn.Linear)]
    patterns = []
    for prefix, module in canonical_named_modules(model):
        globs = getattr(module, KEEP_BF16_ATTR, ())
        where = f"{type(module).__name__}.{KEEP_BF16_ATTR}"
        if isinstance(globs, str) or not all(isinstance(g, str) for g in globs):
            raise ValueError(f"{where}: must be a tuple of globs, got {globs!r} (a one-glob tuple needs its comma: "
                             f"('name',))")
        for glob in globs:
            pattern = f"{prefix}.{glob}" if prefix else glob
            if not any(excluded(fqn, [pattern]) for fqn in linears):
                raise ValueError(f"{where}: {glob!r} names no Linear of {prefix or 'the model'}")
            patterns.append(pattern)
    return sorted(fqn for fqn in linears if excluded(fqn, patterns))


def shared_linears(model: nn.Module) -> dict[str, list[str]]:
    """First FQN -> every FQN of each ``nn.Linear`` module that sits at several places of ``model`` (one module
    object, tied weights): a module swap replaces it at its first place only."""
    places: dict[int, list[str]] = {}
    for fqn, mod in canonical_named_modules(model, remove_duplicate=False):
        if isinstance(mod, nn.Linear):
            places.setdefault(id(mod), []).append(fqn)
    return {fqns[0]: fqns for fqns in places.values() if len(fqns) > 1}


def target_linears(model: nn.Module, *, min_features: int,
                   module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, nn.Linear]:
    """FQN -> nn.Linear for every Linear Dispatch / torchao may convert (see module docstring)."""
    out = {}
    for fqn, mod in canonical_named_modules(model):
        if not isinstance(mod, nn.Linear):
            continue
        k, n = mod.in_features, mod.out_features
        if n == 1 or k % 16 or n % 16 or min(k, n) < min_features:
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        out[fqn] = mod
    return out


def dispatch_exclude(model: nn.Module, config) -> list[str]:
    """What Dispatch keeps BF16 in ``model``: the config's ``exclude`` globs and, with ``keep_declared_bf16``, the
    Linears the model's modules name (``declared_bf16``). A loaded plan's entries for them are dropped too."""
    return [*(config.exclude or ()), *(declared_bf16(model) if config.keep_declared_bf16 else ())]


def configured_targets(model: nn.Module, config, *, module_filter_fn: Optional[ModuleFilter] = None,
                       log: Optional[Callable[[str], None]] = None, dispatch: bool = False) -> dict[str, nn.Linear]:
    """``target_linears`` under a ``LoKAConfig``'s (or ``PrecisionConfig``'s) ``min_features`` and ``exclude``
    (``check_exclude`` first), without a Linear module used at several places (``shared_linears``), a
    parametrized one or one compiled on its own (module docstring), and for ``dispatch`` without the Linears the
    model declares BF16 (``dispatch_exclude``); ``log`` gets a line naming the ones left out."""
    every = target_linears(model, min_features=config.min_features, module_filter_fn=module_filter_fn)
    check_exclude(config.exclude, list(every), where=config.where)
    shared = {fqn: places for fqn, places in shared_linears(model).items() if fqn in every}
    if shared and log is not None:
        log(f"{len(shared)} Linear module(s) used at several places stay BF16 (a swap would convert the first "
            f"place only): " + "; ".join(" = ".join(places) for places in shared.values()))
    computed = [fqn for fqn, mod in every.items() if parametrize.is_parametrized(mod) and fqn not in shared]
    if computed and log is not None:
        log(f"{len(computed)} parametrized Linear(s) stay BF16 (their weight is computed at each call; a swap "
            f"would freeze it): {', '.join(computed)}")
    alone = [fqn for fqn in compiled_alone(model) if fqn in every and fqn not in shared and fqn not in computed]
    if alone and log is not None:
        log(f"{len(alone)} Linear(s) compiled on their own stay BF16 (the compiled forward runs the module it was "
            f"compiled with, not a swapped-in one; compile the module holding it instead): {', '.join(alone)}")
    unswappable = {*shared, *computed, *alone}
    kept = {fqn: mod for fqn, mod in every.items() if not excluded(fqn, config.exclude) and fqn not in unswappable}
    dropped = [fqn for fqn in every if fqn not in kept and fqn not in unswappable]
    if dropped and log is not None:
        log(f"exclude {list(config.exclude)}: {len(dropped)} target Linear(s) stay BF16: {', '.join(dropped)}")
    declared = [fqn for fqn in declared_bf16(model) if fqn in kept] if dispatch and config.keep_declared_bf16 else []
    if declared:
        kept = {fqn: mod for fqn, mod in kept.items() if fqn not in declared}
        if log is not None:
            log(f"{len(declared)} Linear(s) the model keeps BF16 ({KEEP_BF16_ATTR}; "
                f"keep_declared_bf16=false lets Dispatch choose): {', '.join(declared)}")
    return kept


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
