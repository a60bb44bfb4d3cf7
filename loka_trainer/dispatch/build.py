"""Building a Dispatch plan: measure every target Linear at its real calibration input on the device and choose
per GEMM; for each Linear that will run fused with its BlockNorm and HardSwish, also time the fused layer's forward
modes and input-grad backends and choose those.
"""
from __future__ import annotations

import statistics
from typing import Optional

import torch
from torch import nn
from tqdm import tqdm

from loka_trainer.dispatch.calibration import capture_linear_inputs
from loka_trainer.dispatch.config import LoKAConfig
from loka_trainer.dispatch.measure import TimingCache, build_layer_plan
from loka_trainer.dispatch.mods_timing import time_input_grads, time_modes
from loka_trainer.dispatch.plan import DispatchPlan, LayerPlan, ModsChoice
from loka_trainer.dispatch.probe_report import read_probe_report, report_mismatch, report_path, floor_mismatch
from loka_trainer.dispatch.select import Times, accuracy_rejection, as_rounds, select_mods_mode
from loka_trainer.kernels.backends import BASELINE, available_backends
from loka_trainer.kernels.triton_env import triton_importable
from loka_trainer.mods.modes import FORWARD_MODES, ForwardMode
from loka_trainer.mods.ops_fp8 import FUSED_DGRAD
from loka_trainer.mods.transform import find_fusable
from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION
from loka_trainer.timing import Timer, default_timer, wall_clock_timer


def plan_timers(config: LoKAConfig, device) -> tuple[Timer, Timer]:
    """(the GEMM candidates' timer, the fused Mods layers' step timer): ``config.gpu_timer`` and
    ``config.layer_timer`` on CUDA, wall clock (``timing_repeats`` repeats) elsewhere."""
    if torch.device(device).type != "cuda":
        wall = wall_clock_timer(repeats=config.timing_repeats)
        return wall, wall
    return default_timer(device, config.gpu_timer), default_timer(device, config.layer_timer)


def probe_mere_for(linears: dict[str, nn.Linear], config: LoKAConfig) -> dict[str, dict[str, float]]:
    """FQN -> backend -> forward MERE from ``config.probe_stats`` ({} without); ValueError (one line) when the
    report does not fit ``linears`` (`probe_report.report_mismatch`) or was made with other MERE settings
    (`probe_report.floor_mismatch`)."""
    if config.probe_stats is None:
        return {}
    try:
        reported = read_probe_report(config.probe_stats)
    except ValueError as exc:
        raise ValueError(f"{config.where}.probe_stats: {exc}") from None
    wrong = (report_mismatch(reported, {fqn: (m.in_features, m.out_features) for fqn, m in linears.items()})
             or floor_mismatch(config.probe_stats, config.mere_zero_floor))
    if wrong:
        raise ValueError(f"{config.where}.probe_stats: {str(report_path(config.probe_stats))!r} {wrong}")
    return {fqn: layer.mere for fqn, layer in reported.items()}


def candidate_backends(config: LoKAConfig, device) -> dict:
    """The backends Dispatch measures on ``device``: the available ones, or ``config.backends`` of them (and BF16);
    a named one ``device`` cannot run -> one-line ValueError (else the plan is all BF16, each layer "not
    measured")."""
    backends = available_backends(device)
    if config.backends is None:
        return backends
    missing = sorted(set(config.backends) - set(backends))
    if missing:
        raise ValueError(f"{config.where}.backends: {missing} not available on {torch.device(device).type} here; "
                         f"available: {sorted(backends)}")
    return {k: v for k, v in backends.items() if k in config.backends or k == "bf16"}


def build_plan(model: nn.Module, linears: dict[str, nn.Linear], *, config: LoKAConfig, device,
               calibration_batch) -> DispatchPlan:
    """Measure every target Linear at its real calibration input on ``device`` and choose per GEMM."""
    if calibration_batch is None:
        raise ValueError(f"{config.where}.dispatch: needs a calibration batch or a plan file ({config.where}.plan=PATH)")
    backends = candidate_backends(config, device)
    timer, layer_timer = plan_timers(config, device)
    dtype = torch.bfloat16 if config.compute_dtype == "bfloat16" else torch.float32
    inputs = capture_linear_inputs(model, linears, calibration_batch)
    probe = probe_mere_for(linears, config)
    times: TimingCache = {}  # layers of one shape are timed once
    layers = {}
    # disable=None: a bar on a terminal only (building a large model's plan on a GPU takes minutes)
    for fqn, lin in tqdm(linears.items(), desc="LoKA Dispatch: measuring layers", unit="layer", disable=None):
        if fqn not in inputs:  # not reached by this batch's forward: left out of the plan (BF16), and logged
            continue
        x = inputs[fqn].to(device=device, dtype=dtype)
        w = lin.weight.detach().to(device=device, dtype=dtype)
        layers[fqn] = build_layer_plan(x, w, backends, timer=timer, mere_threshold=config.mere_threshold,
                                       min_speedup=config.min_speedup, forward_mere=probe.get(fqn),
                                       timing_cache=times, zero_floor=config.mere_zero_floor,
                                       rounds=config.timing_rounds, outlier_factor=config.timing_outlier_factor,
                                       max_flushed_fraction=config.max_flushed_fraction)
    if config.mods and torch.device(device).type == "cuda" and triton_importable():
        _choose_mods_modes(model, layers, timer=layer_timer, device=device, min_speedup=config.min_speedup,
                           mere_threshold=config.mere_threshold, compiled=config.compile,
                           rounds=config.timing_rounds, outlier_factor=config.timing_outlier_factor,
                           max_flushed_fraction=config.max_flushed_fraction)
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    return DispatchPlan(device=name, layers=layers, mere_threshold=config.mere_threshold,
                        min_speedup=config.min_speedup, max_flushed_fraction=config.max_flushed_fraction)


def fused_input_grad_candidates(lp: LayerPlan, mere_threshold: float,
                                max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION) -> list[str]:
    """The input-grad backends a fused Mods layer is timed with: BF16, the plan's own choice, and each fused FP8
    dgrad (``FUSED_DGRAD``) that passed the accuracy test on the input grad (``select.accuracy_rejection``:
    measured MERE below ``mere_threshold``, flushed fraction at most ``max_flushed_fraction``)."""
    accurate = [b for b in FUSED_DGRAD if b in lp.input_grad.candidates and accuracy_rejection(
        lp.input_grad.candidates[b], mere_threshold=mere_threshold, max_flushed_fraction=max_flushed_fraction) is None]
    return list(dict.fromkeys([BASELINE, lp.input_grad.backend, *accurate]))


def _medians(times: dict[str, Times]) -> dict[str, Optional[float]]:
    """name -> median µs over its rounds (None when it failed): what the plan file records per mode."""
    return {name: None if (r := as_rounds(ts)) is None else statistics.median(r) for name, ts in times.items()}


def forward_mode_offered(mode: ForwardMode, lp: LayerPlan, *, compiled: bool) -> bool:
    """Whether Dispatch times forward ``mode`` for the fused layer planned as ``lp``: an FP8 mode where the forward
    GEMM passed the accuracy test (its backend is FP8); ``plain`` only when the model will be compiled (eager, the
    fused kernels replace its three launches) and all three GEMMs are BF16 (it has no FP8 backward)."""
    if mode.fp8:
        return lp.forward.backend != BASELINE
    if not mode.triton:
        return compiled and lp.forward.backend == BASELINE and mode.takes_backward(lp.input_grad.backend,
                                                                                   lp.weight_grad.backend)
    return True


def _choose_mods_modes(model: nn.Module, layers: dict[str, LayerPlan], *, timer, device, min_speedup: float,
                       mere_threshold: float, compiled: bool = False, rounds: int = 3,
                       outlier_factor: float = 3.0, max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION) -> None:
    """For each planned Linear that LoKA will fuse with its BlockNorm and HardSwish, time every forward mode it
    may run (FP8 modes only where the plan's forward GEMM is FP8, i.e. passed the accuracy test) by the layer's
    whole training step at its shape (``mods_timing.time_modes``: BF16 input grad, the plan's weight grad) and
    record the choice (``LayerPlan.mods_forward``); then, in that mode, time the layer's whole step
    with each input-grad candidate (``fused_input_grad_candidates``) and record that choice
    (``LayerPlan.mods_input_grad``; only when there is an FP8 candidate and the chosen mode is a Triton one).
    Shapes are timed once. ``compiled``: each timed call runs under ``torch.compile``, as the layer will in a
    compiled model, and mode ``plain`` (the plain Mods, which inductor fuses) competes where all three GEMMs are
    BF16 (``forward_mode_offered``). Times come in ``rounds`` interleaved rounds and an FP8 option must win in
    every one (``select.select_mods_mode``)."""
    timed: dict[tuple, dict] = {}
    for fqn, (seq, i) in find_fusable(model).items():
        lp = layers.get(fqn)
        if lp is None:
            continue
        block, eps = seq[i + 1].block_size, seq[i + 1].eps
        is_fp8 = {m: f.fp8 for m, f in FORWARD_MODES.items() if forward_mode_offered(f, lp, compiled=compiled)}
        key = (lp.M, lp.K, lp.N, lp.weight_grad.backend, tuple(is_fp8))
        if key not in timed:
            timed[key] = time_modes(lp.M, lp.K, lp.N, list(is_fp8), wgrad=lp.weight_grad.backend, block=block,
                                    eps=eps, timer=timer, device=device, compiled=compiled, rounds=rounds,
                                    outlier_factor=outlier_factor)
        mode, speedup = select_mods_mode(timed[key], is_fp8, min_speedup=min_speedup)
        lp.mods_forward = ModsChoice(mode=mode, times_us=_medians(timed[key]), speedup=speedup)
        dgrads = fused_input_grad_candidates(lp, mere_threshold, max_flushed_fraction)
        if len(dgrads) == 1 or not FORWARD_MODES[mode].triton:  # plain: BF16 backward GEMMs only
            continue
        key = (lp.M, lp.K, lp.N, mode, lp.weight_grad.backend, tuple(dgrads))
        if key not in timed:
            timed[key] = time_input_grads(lp.M, lp.K, lp.N, dgrads, mode=mode, wgrad=lp.weight_grad.backend,
                                          block=block, eps=eps, timer=timer, device=device, compiled=compiled,
                                          rounds=rounds, outlier_factor=outlier_factor)
        dgrad, speedup = select_mods_mode(timed[key], {d: d != BASELINE for d in dgrads}, min_speedup=min_speedup)
        lp.mods_input_grad = ModsChoice(mode=dgrad, times_us=_medians(timed[key]), speedup=speedup)
