"""apply_precision: the model transform the trainer calls once, before sharding.

- fp32 / bf16: nothing (autocast is the trainer's job, from ``config.compute_dtype``).
- fp8_*: torchao ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``.
- loka (dispatch): build the plan (or load ``config.plan``), swap each target Linear with an FP8 GEMM in the plan
  for a ``LoKALinear`` (all-BF16 ones stay ``nn.Linear``),
  log the plan table, write ``run_dir/dispatch_plan.json``; with ``config.mods`` each Linear -> BlockNorm ->
  HardSwish triple then becomes one ``FusedLinearMods`` using the plan's choices (same state_dict keys).

Targets: ``nn.Linear``s with K and N multiples of 16 and >= ``config.min_features``, never a 1-output
prediction layer, accepted by the optional ``module_filter_fn(module, fqn) -> bool``, and for torchao also
with a real input row count M % 16 == 0 (Dispatch checks M per backend and call). Embedding modules are
TorchRec modules, not ``nn.Linear``, so they are never touched.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from loka_trainer.kernels.backends import BASELINE, available_backends
from loka_trainer.kernels.config import PrecisionConfig
from loka_trainer.kernels.dispatch import (
    Timer, TimingCache, build_layer_plan, default_timer, select_mods_mode, wall_clock_timer,
)
from loka_trainer.kernels.fused_linear import (
    chain_fp8_handoffs, find_fusable, fuse_linear_mods, kernels_from_plan_backends, time_forward_modes,
    time_input_grads,
)
from loka_trainer.kernels.linear import LoKALinear
from loka_trainer.kernels.mods_modes import FORWARD_MODES
from loka_trainer.kernels.mods_ops import FUSED_DGRAD
from loka_trainer.kernels.plan import (
    DispatchPlan, LayerPlan, ModsChoice, format_plan_table, load_plan, save_plan, validate_plan,
)
from loka_trainer.kernels.triton_quant import triton_importable

ModuleFilter = Callable[[nn.Module, str], bool]
PLAN_FILE = "dispatch_plan.json"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _rank0_print(msg: str) -> None:
    if _is_rank0():
        print(msg, flush=True)


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


@torch.no_grad()
def _forward_with_pre_hooks(model: nn.Module, linears: dict[str, nn.Linear], batch,
                            on_input: Callable[[str, nn.Linear, torch.Tensor], None]) -> None:
    """One forward of ``model(batch)`` calling ``on_input(fqn, linear, x)`` before every call of each Linear."""
    def hook_for(fqn: str):
        def hook(mod, args) -> None:  # returns None: a pre-hook's return value would replace the input
            on_input(fqn, mod, args[0])
        return hook

    handles = [m.register_forward_pre_hook(hook_for(fqn)) for fqn, m in linears.items()]
    try:
        model(batch)
    finally:
        for h in handles:
            h.remove()


def capture_linear_inputs(model: nn.Module, linears: dict[str, nn.Linear], batch) -> dict[str, torch.Tensor]:
    """FQN -> that Linear's real input (its first call) as (M, K)."""
    captured: dict[str, torch.Tensor] = {}
    _forward_with_pre_hooks(model, linears, batch, lambda fqn, mod, x: captured.setdefault(
        fqn, x.detach().reshape(-1, mod.in_features).clone()))
    return captured


def linear_input_rows(model: nn.Module, linears: dict[str, nn.Linear], batch) -> dict[str, set[int]]:
    """FQN -> the row counts M of every call of that Linear (one Linear may run on several inputs, e.g. tokens
    and learned seeds)."""
    rows: dict[str, set[int]] = {}
    _forward_with_pre_hooks(model, linears, batch, lambda fqn, mod, x: rows.setdefault(fqn, set()).add(
        x.numel() // mod.in_features))
    return rows


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


def read_probe_mere(stats_dir: Optional[str]) -> dict[str, dict[str, float]]:
    """LoKA Probe report (STATS_DIR/report.json) -> FQN -> backend -> forward MERE ({} when no dir)."""
    if stats_dir is None:
        return {}
    report = json.loads((Path(stats_dir) / "report.json").read_text())
    out: dict[str, dict[str, float]] = {}
    for fqn, entry in report.get("layers", {}).items():
        cands = entry.get("candidates", {})
        out[fqn] = {name: float(c["mere"]) for name, c in cands.items() if c.get("mere") is not None}
    return out


def plan_timers(config: PrecisionConfig, device) -> tuple[Timer, Timer]:
    """(the GEMM candidates' timer, the fused Mods layers' step timer): ``precision.gpu_timer`` and
    ``precision.layer_timer`` on CUDA, wall clock (``timing_repeats`` repeats) elsewhere."""
    if torch.device(device).type != "cuda":
        wall = wall_clock_timer(repeats=config.timing_repeats)
        return wall, wall
    return default_timer(device, config.gpu_timer), default_timer(device, config.layer_timer)


def build_plan(model: nn.Module, linears: dict[str, nn.Linear], *, config: PrecisionConfig, device,
               calibration_batch) -> DispatchPlan:
    """Measure every target Linear at its real calibration input on ``device`` and choose per GEMM."""
    if calibration_batch is None:
        raise ValueError("precision.dispatch: needs a calibration batch or a plan file (precision.plan=PATH)")
    backends = available_backends(device)
    if config.backends is not None:
        backends = {k: v for k, v in backends.items() if k in config.backends or k == "bf16"}
    timer, layer_timer = plan_timers(config, device)
    dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32
    inputs = capture_linear_inputs(model, linears, calibration_batch)
    probe = read_probe_mere(config.probe_stats)
    times: TimingCache = {}  # layers of one shape are timed once
    layers = {}
    # disable=None: a bar on a terminal only (building a large model's plan on a GPU takes minutes)
    for fqn, lin in tqdm(linears.items(), desc="LoKA Dispatch: measuring layers", unit="layer", disable=None):
        if fqn not in inputs:  # not reached by this batch's forward: leave it BF16 and say so in the plan
            continue
        x = inputs[fqn].to(device=device, dtype=dtype)
        w = lin.weight.detach().to(device=device, dtype=dtype)
        layers[fqn] = build_layer_plan(x, w, backends, timer=timer, mere_threshold=config.mere_threshold,
                                       min_speedup=config.min_speedup, forward_mere=probe.get(fqn),
                                       timing_cache=times, zero_floor=config.mere_zero_floor)
    if config.mods and torch.device(device).type == "cuda" and triton_importable():
        _choose_mods_modes(model, layers, timer=layer_timer, device=device, min_speedup=config.min_speedup,
                           mere_threshold=config.mere_threshold)
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    return DispatchPlan(device=name, layers=layers, mere_threshold=config.mere_threshold,
                        min_speedup=config.min_speedup)


def fused_input_grad_candidates(lp: LayerPlan, mere_threshold: float) -> list[str]:
    """The input-grad backends a fused Mods layer is timed with: BF16, the plan's own choice, and each fused FP8
    dgrad (``FUSED_DGRAD``) whose measured input-grad MERE is below ``mere_threshold``."""
    accurate = [b for b in FUSED_DGRAD
                if (err := lp.input_grad.candidate_mere(b)) is not None and err < mere_threshold]
    return list(dict.fromkeys([BASELINE, lp.input_grad.backend, *accurate]))


def _choose_mods_modes(model: nn.Module, layers: dict[str, LayerPlan], *, timer, device, min_speedup: float,
                       mere_threshold: float) -> None:
    """For each planned Linear that LoKA will fuse with its BlockNorm and HardSwish, time every forward mode it
    may run (FP8 modes only where the plan's forward GEMM is FP8, i.e. passed the accuracy test) at the layer's
    shape and record the choice (``LayerPlan.mods_forward``); then, in that mode, time the layer's whole step
    with each input-grad candidate (``fused_input_grad_candidates``) and record that choice
    (``LayerPlan.mods_input_grad``; only when there is an FP8 candidate). Shapes are timed once."""
    timed: dict[tuple, dict] = {}
    for fqn, (seq, i) in find_fusable(model).items():
        lp = layers.get(fqn)
        if lp is None:
            continue
        block, eps = seq[i + 1].block_size, seq[i + 1].eps
        is_fp8 = {m: f.fp8 for m, f in FORWARD_MODES.items() if not f.fp8 or lp.forward.backend != BASELINE}
        key = (lp.M, lp.K, lp.N, tuple(is_fp8))
        if key not in timed:
            timed[key] = time_forward_modes(lp.M, lp.K, lp.N, list(is_fp8), block=block, eps=eps, timer=timer,
                                            device=device)
        mode, speedup = select_mods_mode(timed[key], is_fp8, min_speedup=min_speedup)
        lp.mods_forward = ModsChoice(mode=mode, times_us=timed[key], speedup=speedup)
        dgrads = fused_input_grad_candidates(lp, mere_threshold)
        if len(dgrads) == 1:
            continue
        key = (lp.M, lp.K, lp.N, mode, lp.weight_grad.backend, tuple(dgrads))
        if key not in timed:
            timed[key] = time_input_grads(lp.M, lp.K, lp.N, dgrads, mode=mode, wgrad=lp.weight_grad.backend,
                                          block=block, eps=eps, timer=timer, device=device)
        dgrad, speedup = select_mods_mode(timed[key], {d: d != BASELINE for d in dgrads}, min_speedup=min_speedup)
        lp.mods_input_grad = ModsChoice(mode=dgrad, times_us=timed[key], speedup=speedup)


def _broadcast_plan(plan: Optional[DispatchPlan]) -> DispatchPlan:
    """Rank 0's plan on every rank, so all ranks run the same kernels (no-op without distributed)."""
    if not dist.is_initialized():
        assert plan is not None
        return plan
    obj = [plan.to_dict() if plan is not None else None]
    dist.broadcast_object_list(obj, src=0)
    return DispatchPlan.from_dict(obj[0])


def swap_in_lokalinears(model: nn.Module, plan: DispatchPlan) -> None:
    """Replace each planned Linear with at least one non-BF16 GEMM (by FQN) with a LoKALinear sharing its
    parameters. An all-BF16 layer stays the ``nn.Linear`` it was: the same GEMMs with no
    autograd Function, per-layer plan attributes or compile guards around them (host time per step), and
    modules that compute a plain Linear their own way keep doing so (``models.layers.TokenMix``)."""
    for fqn, lp in plan.layers.items():
        if all(b == BASELINE for b in lp.backends().values()):
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoKALinear.from_linear(getattr(parent, child), lp.backends()))


def _apply_torchao(model: nn.Module, recipe: str, linears: dict[str, nn.Linear]) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    targets = set(linears)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda mod, fqn: fqn in targets)


def _fuse_mods(model: nn.Module, plan: DispatchPlan, *, module_filter_fn: Optional[ModuleFilter],
               log: Callable[[str], None]) -> None:
    """Mods on: each Linear -> BlockNorm -> HardSwish becomes one FusedLinearMods with the plan's GEMM choices."""
    kernels = {fqn: kernels_from_plan_backends(lp.backends(), lp.mods_forward, lp.mods_input_grad)
               for fqn, lp in plan.layers.items()}
    fused = fuse_linear_mods(model, kernels=kernels, module_filter_fn=module_filter_fn)
    chained = chain_fp8_handoffs(model)
    log(f"LoKA Mods: {len(fused)} Linear -> BlockNorm -> HardSwish triple(s) fused into FusedLinearMods, "
        f"{len(chained)} of them read their input in FP8 from the previous one's epilogue")


# A compiled frame keeps one graph per distinct guard set. LoKA layers carry per-layer kernel choices (Python
# strings the graph specializes on), so N same-class blocks with different plans need N entries per grad mode
# and input dtype; past dynamo's recompile limit (default 8) the remaining ones silently run eagerly.
COMPILE_ENTRIES_PER_LAYER = 4


def reserve_compile_cache(num_layers: int, log: Callable[[str], None]) -> None:
    """Raise dynamo's per-frame recompile limit to COMPILE_ENTRIES_PER_LAYER · num_layers (never lower it)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    want = COMPILE_ENTRIES_PER_LAYER * num_layers
    if getattr(cfg, name) < want:
        setattr(cfg, name, want)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * want)
        log(f"torch._dynamo.config.{name} raised to {want} for {num_layers} LoKA layers (one compiled graph "
            f"per distinct layer plan, grad mode and input dtype)")


def apply_precision(model: nn.Module, *, config: PrecisionConfig, device, calibration_batch=None,
                    run_dir: Optional[Path] = None, module_filter_fn: Optional[ModuleFilter] = None,
                    log: Callable[[str], None] = _rank0_print) -> Optional[DispatchPlan]:
    """Transform ``model`` in place for ``config``; returns the Dispatch plan when Dispatch is on."""
    config.validate()
    linears = target_linears(model, min_features=config.min_features, module_filter_fn=module_filter_fn)
    if config.fp8_recipe is not None:
        linears = drop_unaligned_rows(model, linears, calibration_batch, log)
        _apply_torchao(model, config.fp8_recipe, linears)
        log(f"precision={config.name}: torchao float8 '{config.fp8_recipe}' on {len(linears)} Linear(s)")
        return None
    if not config.dispatch:
        return None
    if config.plan is not None:
        plan = load_plan(config.plan)
    else:
        plan = build_plan(model, linears, config=config, device=device,
                          calibration_batch=calibration_batch) if _is_rank0() else None
        plan = _broadcast_plan(plan)
    validate_plan(plan, {f: (m.in_features, m.out_features) for f, m in linears.items()},
                  list(available_backends(device)), mods_modes={m: f.fp8 for m, f in FORWARD_MODES.items()})
    swap_in_lokalinears(model, plan)
    reserve_compile_cache(len(plan.layers), log)  # an upper bound: fused Mods layers carry their plan too
    log(format_plan_table(plan))
    if config.mods:
        _fuse_mods(model, plan, module_filter_fn=module_filter_fn, log=log)
    if run_dir is not None and _is_rank0():
        log(f"dispatch plan written to {save_plan(plan, Path(run_dir) / PLAN_FILE)}")
    return plan
