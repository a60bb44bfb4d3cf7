"""Dispatch's measurements of one Linear: each candidate backend's MERE, flushed fraction and time (µs) per GEMM at
the layer's real shape, and the layer's plan from them.

MERE is ``probe.mere.mere`` (the Probe's too); the flushed fraction is ``probe.flush.flushed_fraction`` of the
layer's real operands (x, W) under the backend's declared scaling (``GemmBackend.operand_scaling``); times come
from a ``loka_trainer.timing`` timer.
``measure_gemm`` produces the numbers; ``select.select_backend`` is the rule; ``build_layer_plan`` joins them.
"""
from __future__ import annotations

import statistics
import warnings
from typing import Any, Callable, Optional

import torch

from loka_trainer.dispatch.plan import GemmChoice, LayerPlan
from loka_trainer.dispatch.select import outlier_rounds, select_backend
from loka_trainer.kernels.backend_base import GEMMS, GemmBackend
from loka_trainer.kernels.backends import BASELINE
from loka_trainer.matmul_precision import exact_fp32_matmuls
from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION, gemm_flushed_fraction
from loka_trainer.probe.mere import DEFAULT_ZERO_FLOOR, mere
from loka_trainer.timing import Timer

# (backend, gemm, M, K, N, dtype) -> µs per timing round: a GEMM's time depends on its shape, not its values, so
# layers of one shape (e.g. the N identical blocks of a model) are timed once per plan and get the same timings.
TimingCache = dict[tuple[str, str, int, int, int, str], Optional[list[float]]]

DEFAULT_ROUNDS = 3  # independent timing rounds per GEMM (``LoKAConfig.timing_rounds``)
DEFAULT_OUTLIER_FACTOR = 3.0  # a round > this × the median of the others is re-timed (``timing_outlier_factor``)


def time_rounds(calls: dict[str, Callable[[], object]], timer: Timer, *, rounds: int = DEFAULT_ROUNDS,
                outlier_factor: float = DEFAULT_OUTLIER_FACTOR) -> dict[str, Optional[list[float]]]:
    """name -> its time (µs) in each of ``rounds`` independent rounds.

    Each round times every call once (``timer``: itself a median of repeats), interleaved and in an order
    rotated by one per round, so slow drift (clocks, another process) hits all candidates alike. Then each round
    more than ``outlier_factor`` × the median of that call's other rounds (``select.outlier_rounds``) is timed
    once more and replaced. A call that raises RuntimeError -> None (with a warning): a kernel that fails at this
    shape is not a candidate, never an error.
    """
    names = list(calls)
    times: dict[str, Optional[list[float]]] = {n: [] for n in names}
    for r in range(max(1, rounds)):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if times[name] is None:
                continue
            try:
                times[name].append(float(timer(calls[name])))
            except RuntimeError as exc:
                warnings.warn(f"dispatch: {name} failed while timed, not a candidate: "
                              f"{str(exc).splitlines()[0][:200]}")
                times[name] = None
    for name, ts in times.items():
        for i in outlier_rounds(ts or [], outlier_factor):
            try:
                ts[i] = float(timer(calls[name]))
            except RuntimeError:  # it ran in every round: keep the outlier, the every-round rule weighs it
                pass
    return times


def _is_fp8(backend: GemmBackend, gemm: str) -> bool:
    """``backend.is_fp8(gemm)``; a duck-typed user kernel without it counts as FP8 in every GEMM."""
    is_fp8 = getattr(backend, "is_fp8", None)
    return True if is_fp8 is None else bool(is_fp8(gemm))


def _gemm_call(backend: GemmBackend, gemm: str, x: torch.Tensor, w: torch.Tensor,
               dy: torch.Tensor) -> Callable[[], torch.Tensor]:
    return {
        "forward": lambda: backend.forward(x, w),
        "input_grad": lambda: backend.input_grad(dy, w),
        "weight_grad": lambda: backend.weight_grad(dy, x),
    }[gemm]


def calibration_operands(gemm: str, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The NT operands of ``gemm`` that calibration knows, by role: x (M, K) and w (N, K) as forward's a and b,
    Wᵀ (K, N) as input_grad's b, xᵀ (K, M) as weight_grad's b. dy is drawn, not known, so it is not measured."""
    return {"forward": {"a": x, "b": w}, "input_grad": {"b": w.t()}, "weight_grad": {"b": x.t()}}[gemm]


@torch.no_grad()
def fp32_reference(gemm: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The TF32-free fp32 result of one GEMM (x (M,K), w (N,K), dy (M,N))."""
    x, w, dy = x.float(), w.float(), dy.float()
    with exact_fp32_matmuls():
        return {"forward": lambda: x @ w.t(), "input_grad": lambda: dy @ w, "weight_grad": lambda: dy.t() @ x}[gemm]()


@torch.no_grad()
def measure_gemm(gemm: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                 backends: dict[str, GemmBackend], *, timer: Timer,
                 known_mere: Optional[dict[str, float]] = None, timing_cache: Optional[TimingCache] = None,
                 zero_floor: float = DEFAULT_ZERO_FLOOR, rounds: int = DEFAULT_ROUNDS,
                 outlier_factor: float = DEFAULT_OUTLIER_FACTOR) -> dict[str, dict[str, Any]]:
    """MERE vs fp32, flushed fraction and time (µs) of one GEMM for each backend that supports the shape and runs
    this GEMM in FP8 (``GemmBackend.is_fp8``: a backend whose GEMM is high precision is BF16 there, not a distinct
    choice).

    x (M, K), w (N, K), dy (M, N). ``known_mere`` (e.g. from LoKA Probe statistics) replaces the measured
    MERE for the backends it names; ``timing_cache`` reuses (and collects) times by shape; ``zero_floor``: see
    ``probe.mere``; ``rounds`` / ``outlier_factor``: see ``time_rounds``. Returns
    name -> {"mere", "flushed" (``gemm_flushed_fraction``; FP8 backends only), "time_us" (median over rounds),
    "times_us" (one per round)}; bf16 is always included.
    """
    M, K = x.shape
    N = w.shape[0]
    ref = fp32_reference(gemm, x, w, dy)
    times: TimingCache = {} if timing_cache is None else timing_cache
    out: dict[str, dict[str, Any]] = {}
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    flushed_cache: dict = {}
    for name, backend in backends.items():
        if not backend.supports(M, K, N) or (name != BASELINE and not _is_fp8(backend, gemm)):
            continue
        call = _gemm_call(backend, gemm, x, w, dy)
        err = (known_mere or {}).get(name)
        try:
            out[name] = {"mere": float(err) if err is not None else float(mere(call(), ref, zero_floor=zero_floor))}
            calls[name] = call
        except RuntimeError as exc:  # a kernel that fails at this shape is not a candidate, never an error
            warnings.warn(f"dispatch: {name} {gemm} failed at M×K×N={M}×{K}×{N}, not a candidate: "
                          f"{str(exc).splitlines()[0][:200]}")
            out[name] = {"mere": None, "time_us": None}
            continue
        if name != BASELINE:
            out[name]["flushed"] = gemm_flushed_fraction(backend, gemm, calibration_operands(gemm, x, w),
                                                         cache=flushed_cache)
    key = lambda name: (name, gemm, M, K, N, str(x.dtype))  # noqa: E731
    todo = {name: call for name, call in calls.items() if key(name) not in times}
    times.update({key(name): ts for name, ts in
                  time_rounds(todo, timer, rounds=rounds, outlier_factor=outlier_factor).items()})
    for name in calls:
        ts = times[key(name)]
        if ts is None:
            out[name] = {"mere": None, "time_us": None}
        else:
            out[name].update(time_us=statistics.median(ts), times_us=list(ts))
    return out


def build_layer_plan(x: torch.Tensor, w: torch.Tensor, backends: dict[str, GemmBackend], *, timer: Timer,
                     mere_threshold: float, min_speedup: float,
                     forward_mere: Optional[dict[str, float]] = None, seed: int = 0,
                     timing_cache: Optional[TimingCache] = None,
                     zero_floor: float = DEFAULT_ZERO_FLOOR, rounds: int = DEFAULT_ROUNDS,
                     outlier_factor: float = DEFAULT_OUTLIER_FACTOR,
                     max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION) -> LayerPlan:
    """Measure and choose all three GEMMs of one Linear: x (M, K) its real input, w (N, K) its weight.

    The output gradient dy (M, N) is not known before training: it is drawn N(0, 1) with a fixed seed, so
    input_grad / weight_grad MERE are "normal-input" estimates (the forward MERE uses the real x, or the
    probe's ``forward_mere`` when given); flushed fractions are of the real x and w only. ``timing_cache``,
    ``rounds``, ``outlier_factor``: see ``measure_gemm``; ``max_flushed_fraction``: see ``select.select_backend``.
    """
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(x.shape[0], w.shape[0], generator=gen).to(device=x.device, dtype=x.dtype)
    plan = LayerPlan(M=x.shape[0], K=x.shape[1], N=w.shape[0])
    for gemm in GEMMS:
        cands = measure_gemm(gemm, x, w, dy, backends, timer=timer,
                             known_mere=forward_mere if gemm == "forward" else None, timing_cache=timing_cache,
                             zero_floor=zero_floor, rounds=rounds, outlier_factor=outlier_factor)
        bf16_t = cands.get(BASELINE, {}).get("time_us")
        choice = select_backend(cands, cands.get(BASELINE, {}).get("times_us"), mere_threshold=mere_threshold,
                                min_speedup=min_speedup, max_flushed_fraction=max_flushed_fraction)
        chosen = cands.get(choice, {})
        setattr(plan, gemm, GemmChoice(backend=choice, mere=chosen.get("mere"), flushed=chosen.get("flushed"),
                                       time_us=chosen.get("time_us"), bf16_time_us=bf16_t, candidates=cands))
    return plan
