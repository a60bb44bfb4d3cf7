"""convert_to_loka: put LoKA into a model in place (the Mods fusion and Dispatch), as torchao's
``convert_to_float8_training`` does for its uniform recipes.

With ``config.dispatch``: build the plan on the calibration batch (or load ``config.plan``), swap each target
Linear with an FP8 GEMM in the plan for a ``LoKALinear`` (all-BF16 ones stay ``nn.Linear``), log the plan table,
write ``run_dir/dispatch_plan.json`` (a loaded plan file is copied byte for byte, and never rewritten when it
is that file: a reused plan is reproduced exactly; ``config.exclude`` drops layers from it on every load). With
``config.mods``: each Linear -> BlockNorm -> HardSwish triple then becomes one ``FusedLinearMods`` running the
plan's choices (same state_dict keys).
Targets: ``dispatch.targets``.
The FP8 weight operands are cached per optimizer step: attach ``register_weight_cache_hook(model, optimizer)``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from loka_trainer.atomic_files import atomic_copy
from loka_trainer.dispatch.broadcast import broadcast_plan, is_rank0, rank0_print
from loka_trainer.dispatch.build import build_plan
from loka_trainer.dispatch.config import DISPATCH_ONLY_FIELDS, LoKAConfig
from loka_trainer.dispatch.plan import (DispatchPlan, ModsChoice, load_plan, save_plan, validate_plan,
                                        without_excluded)
from loka_trainer.dispatch.plan_table import format_plan_table
from loka_trainer.dispatch.targets import ModuleFilter, configured_targets, dispatch_exclude
from loka_trainer.kernels.backends import BASELINE, available_backends
from loka_trainer.kernels.linear import LoKALinear
from loka_trainer.module_names import canonical_fqns, canonical_named_modules
from loka_trainer.mods.modes import FORWARD_MODES, default_forward_mode
from loka_trainer.mods.module import FusedLinearMods
from loka_trainer.mods.transform import chain_fp8_handoffs, find_unfusable, fuse_linear_mods
from loka_trainer.output_dirs import unwritable_reason

PLAN_FILE = "dispatch_plan.json"


def swap_in_lokalinears(model: nn.Module, plan: DispatchPlan) -> nn.Module:
    """Replace each planned Linear with at least one non-BF16 GEMM (by canonical FQN, ``module_names``: inside a
    compiled or wrapped part of the model too) with a LoKALinear sharing its parameters (torchao's
    ``swap_linear_layers``). An all-BF16 layer stays the ``nn.Linear`` it was: the same GEMMs with no autograd
    Function, per-layer plan attributes or compile guards around them (host time per step), and modules that
    compute a plain Linear their own way keep doing so (``models.layers.TokenMix``). Returns the model (a new
    module only when the model itself is a planned Linear)."""
    from torchao.float8.float8_linear_utils import swap_linear_layers  # noqa: PLC0415 -- torchao imports slowly

    fp8_layers = {fqn: lp.backends() for fqn, lp in plan.layers.items()
                  if any(b != BASELINE for b in lp.backends().values())}
    chosen: dict[int, dict[str, str]] = {}  # id(Linear) -> its backends, from the filter that sees the FQN
    names = canonical_fqns(model)

    def take(module: nn.Module, fqn: str) -> bool:
        if isinstance(module, nn.Linear) and (name := names.get(fqn)) in fp8_layers:
            chosen[id(module)] = fp8_layers[name]
            return True
        return False

    return swap_linear_layers(model, lambda lin: LoKALinear.from_linear(lin, chosen[id(lin)]), module_filter_fn=take)


def kernels_from_plan_backends(backends: dict[str, str], mods: Optional[ModsChoice] = None,
                               mods_input_grad: Optional[ModsChoice] = None, *, compiled: bool = False
                               ) -> dict[str, str]:
    """A layer plan's per-GEMM choice {forward, input_grad, weight_grad} -> the FusedLinearMods kernels {mode,
    dgrad, wgrad}.

    The forward mode is the plan's measured one (``mods``: timed per layer when the plan was built on a GPU,
    ``dispatch.build``); without it, a forward that Dispatch found worth FP8 runs the fused kernel on
    rowwise-FP8 inputs, a BF16 forward ``mods.modes.default_forward_mode(compiled=compiled)`` (``plain`` for a
    model that will be compiled, when both backward GEMMs are BF16 too). The two backward GEMMs keep the plan's
    backends; a ``scaled_mm_rowwise`` or ``scaled_mm_tensorwise`` dgrad then runs fused (dz amax from the dz
    kernel, one cast pass, ``mods.ops_fp8.FUSED_DGRAD``) with the backend's numerics. ``mods_input_grad`` (timed
    over the whole layer when the plan was built on a GPU) replaces the plan's input-grad backend.
    """
    dgrad = mods_input_grad.mode if mods_input_grad is not None else backends.get("input_grad", BASELINE)
    wgrad = backends.get("weight_grad", BASELINE)
    if mods is not None:
        mode = mods.mode
    elif backends.get("forward", BASELINE) != BASELINE:
        mode = "fused_fp8"
    else:
        mode = default_forward_mode(compiled=compiled, dgrad=dgrad, wgrad=wgrad)
    return {"mode": mode, "dgrad": dgrad, "wgrad": wgrad}


def fuse_with_plan(model: nn.Module, plan: DispatchPlan, *, module_filter_fn: Optional[ModuleFilter],
                   log: Callable[[str], None], compiled: bool = False) -> list[str]:
    """Each Linear -> BlockNorm -> HardSwish becomes one FusedLinearMods with the plan's choices (all BF16, in
    ``default_forward_mode(compiled=compiled)``, for a layer the plan does not name); returns the fused Linear
    FQNs."""
    kernels = {fqn: kernels_from_plan_backends(lp.backends(), lp.mods_forward, lp.mods_input_grad, compiled=compiled)
               for fqn, lp in plan.layers.items()}
    unfusable = find_unfusable(model, module_filter_fn=module_filter_fn)
    fused = fuse_linear_mods(model, kernels=kernels, module_filter_fn=module_filter_fn,
                             default_mode=default_forward_mode(compiled=compiled))
    chained = chain_fp8_handoffs(model)
    unfused = ""
    if unfusable:
        shown = ", ".join(f"{fqn} ({why})" for fqn, why in list(unfusable.items())[:4])
        more = ", ..." if len(unfusable) > 4 else ""
        unfused = f"; {len(unfusable)} stay unfused, as the kernels need: {shown}{more}"
    log(f"LoKA Mods: {len(fused)} Linear -> BlockNorm -> HardSwish triple(s) fused into FusedLinearMods, "
        f"{len(chained)} of them read their input in FP8 from the previous one's epilogue{unfused}")
    return fused


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def convert_to_loka(model: nn.Module, config: LoKAConfig, *, calibration_batch=None,
                    module_filter_fn: Optional[ModuleFilter] = None, device=None, run_dir: Optional[Path] = None,
                    log: Callable[[str], None] = rank0_print) -> DispatchPlan:
    """Convert ``model`` in place for ``config`` and return the Dispatch plan (empty without ``config.dispatch``).

    ``calibration_batch``: one real input, ``model(calibration_batch)``, that Dispatch measures each target
    Linear at (not needed with ``config.plan``). ``module_filter_fn(module, fqn) -> bool`` restricts the targets
    and the fused triples. ``device``: where Dispatch measures (default: CUDA if available, else CPU). Under
    torch.distributed rank 0 measures and broadcasts its plan (a collective: call it on every rank). A model
    wrapped by ``torch.compile`` or DDP is converted inside the wrapper (``unwrapped``); a compiled part of it
    inside its wrapper too, and every layer is named without the wrappers (``module_names.canonical_named_modules``):
    a plan fits the model compiled whole, in parts or not at all.
    """
    if not isinstance(config, LoKAConfig):
        raise TypeError(f"convert_to_loka: config must be a LoKAConfig, got {type(config).__name__}")
    config.validate()
    model = unwrapped(model)
    check_convertible(model, config, run_dir)
    converted = [fqn for fqn, m in canonical_named_modules(model) if isinstance(m, (LoKALinear, FusedLinearMods))]
    if converted:  # its plan would cover only the layers still plain, and run_dir's plan would be replaced
        raise ValueError(f"the model already holds {len(converted)} LoKA layer(s) ({', '.join(converted[:3])}"
                         f"{', ...' if len(converted) > 3 else ''}): convert_to_loka converts a model once; to convert "
                         f"with another config, build the model again (its state_dict loads into either)")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if not config.dispatch:
        plan = DispatchPlan(device=_device_name(device), layers={}, mere_threshold=config.mere_threshold,
                            min_speedup=config.min_speedup, max_flushed_fraction=config.max_flushed_fraction)
    else:
        linears = configured_targets(model, config, module_filter_fn=module_filter_fn, log=log, dispatch=True)
        if config.plan is not None:
            plan = without_excluded(load_plan(config.plan, where=f"{config.where}.plan"),
                                    dispatch_exclude(model, config))
            if unread := config.unread_with_plan():
                log(f"the plan {config.plan} runs as it was measured; these settings are not read: {', '.join(unread)}")
        else:
            plan = build_plan(model, linears, config=config, device=device,
                              calibration_batch=calibration_batch) if is_rank0() else None
            plan = broadcast_plan(plan)
        unplanned = [fqn for fqn in linears if fqn not in plan.layers]
        if unplanned:  # a loaded plan may come from a smaller model or config, or have been trimmed by hand
            why = "the calibration batch's forward did not reach" if config.plan is None else "the plan does not name"
            log(f"{len(unplanned)} target Linear(s) {why} stay BF16: " + ", ".join(unplanned))
        validate_plan(plan, {f: (m.in_features, m.out_features) for f, m in linears.items()},
                      list(available_backends(device)), mods_modes={m: f.fp8 for m, f in FORWARD_MODES.items()})
        swap_in_lokalinears(model, plan)
        log(format_plan_table(plan))
    if config.mods:
        fuse_with_plan(model, plan, module_filter_fn=module_filter_fn, log=log, compiled=config.compile)
    if config.dispatch and run_dir is not None and is_rank0():  # kept as loaded: ``exclude`` applies on each load
        log(record_plan(plan, Path(run_dir) / PLAN_FILE, source=config.plan))
    return plan


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's model inside ``torch.compile``'s and DDP's wrappers, which share its modules: converted there,
    Dispatch's calibration forward compiles nothing (a compiled submodule's still compiles) and the bare-Linear
    check sees the model itself."""
    from torch._dynamo.eval_frame import OptimizedModule  # noqa: PLC0415 -- dynamo imports slowly
    wrappers = {OptimizedModule: "_orig_mod", nn.parallel.DistributedDataParallel: "module"}
    while (inner := next((a for cls, a in wrappers.items() if isinstance(model, cls)), None)) is not None:
        model = getattr(model, inner)
    return model


def check_convertible(model: nn.Module, config: LoKAConfig, run_dir: Optional[Path]) -> None:
    """One-line ValueError, before anything is measured or changed, for what ``convert_to_loka`` cannot do: a
    ``model`` that is itself an ``nn.Linear`` (it is replaced in place inside its parent; a bare one has none), a
    ``run_dir`` its plan cannot be written to, or plan settings set with ``dispatch=False`` (nothing reads them)."""
    if isinstance(model, nn.Linear):
        raise ValueError("convert_to_loka converts the Linears inside a model in place; a bare nn.Linear has no "
                         "parent to hold its replacement: wrap it, e.g. nn.Sequential(linear)")
    if run_dir is not None and (reason := unwritable_reason(Path(run_dir))) is not None:
        raise ValueError(f"convert_to_loka: run_dir {str(run_dir)!r} cannot hold the plan: {reason}")
    unread = [f for f in DISPATCH_ONLY_FIELDS if getattr(config, f) is not None]
    if not config.dispatch and unread:
        raise ValueError(f"{config.where}.dispatch is False, so nothing reads {', '.join(unread)}: "
                         f"unset {'it' if len(unread) == 1 else 'them'} or set dispatch=True")


def record_plan(plan: DispatchPlan, dest: Path, *, source: Optional[str]) -> str:
    """Keep the run's plan at ``dest``: a measured plan is saved; a loaded one (``source``) is copied byte for
    byte (atomically), or left alone when ``dest`` is that file. Returns the line to log."""
    if source is None:
        return f"dispatch plan written to {save_plan(plan, dest)}"
    if dest.exists() and dest.resolve() == Path(source).resolve():
        return f"dispatch plan {dest} reused as it is (not rewritten)"
    atomic_copy(Path(source), dest)
    return f"dispatch plan {source} copied to {dest}"
