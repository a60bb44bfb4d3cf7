"""Dispatch's measurements of one Linear: each candidate backend's MERE and time (µs) per GEMM at the layer's real
shape, and the layer's plan from them.

MERE is ``probe.mere.mere`` (the Probe's too); times come from a ``loka_trainer.timing`` timer.
``measure_gemm`` produces the numbers; ``select.select_backend`` is the rule; ``build_layer_plan`` joins them.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from loka_trainer.dispatch.plan import GemmChoice, LayerPlan
from loka_trainer.dispatch.select import select_backend
from loka_trainer.kernels.backend_base import GEMMS, GemmBackend
from loka_trainer.kernels.backends import BASELINE
from loka_trainer.probe.mere import DEFAULT_ZERO_FLOOR, mere
from loka_trainer.timing import Timer

# (backend, gemm, M, K, N, dtype) -> µs: a GEMM's time depends on its shape, not its values, so layers of one
# shape (e.g. the N identical blocks of a model) are timed once per plan and get the same timings.
TimingCache = dict[tuple[str, str, int, int, int, str], float]


def _gemm_call(backend: GemmBackend, gemm: str, x: torch.Tensor, w: torch.Tensor,
               dy: torch.Tensor) -> Callable[[], torch.Tensor]:
    return {
        "forward": lambda: backend.forward(x, w),
        "input_grad": lambda: backend.input_grad(dy, w),
        "weight_grad": lambda: backend.weight_grad(dy, x),
    }[gemm]


@torch.no_grad()
def fp32_reference(gemm: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The TF32-free fp32 result of one GEMM (x (M,K), w (N,K), dy (M,N))."""
    x, w, dy = x.float(), w.float(), dy.float()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return {"forward": lambda: x @ w.t(), "input_grad": lambda: dy @ w, "weight_grad": lambda: dy.t() @ x}[gemm]()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@torch.no_grad()
def measure_gemm(gemm: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                 backends: dict[str, GemmBackend], *, timer: Timer,
                 known_mere: Optional[dict[str, float]] = None, timing_cache: Optional[TimingCache] = None,
                 zero_floor: float = DEFAULT_ZERO_FLOOR) -> dict[str, dict[str, Optional[float]]]:
    """MERE vs fp32 and time (µs) of one GEMM for each backend that supports the shape.

    x (M, K), w (N, K), dy (M, N). ``known_mere`` (e.g. from LoKA Probe statistics) replaces the measured
    MERE for the backends it names; ``timing_cache`` reuses (and collects) times by shape; ``zero_floor``: see
    ``probe.mere``. Returns
    name -> {"mere", "time_us"}; bf16 is always included.
    """
    M, K = x.shape
    N = w.shape[0]
    ref = fp32_reference(gemm, x, w, dy)
    times: TimingCache = {} if timing_cache is None else timing_cache
    out: dict[str, dict[str, Optional[float]]] = {}
    for name, backend in backends.items():
        if not backend.supports(M, K, N):
            continue
        call = _gemm_call(backend, gemm, x, w, dy)
        err = (known_mere or {}).get(name)
        try:
            err = float(err) if err is not None else float(mere(call(), ref, zero_floor=zero_floor))
            key = (name, gemm, M, K, N, str(x.dtype))
            if key not in times:
                times[key] = timer(call)
            out[name] = {"mere": err, "time_us": times[key]}
        except RuntimeError as exc:  # a kernel that fails at this shape is not a candidate, never an error
            warnings.warn(f"dispatch: {name} {gemm} failed at M×K×N={M}×{K}×{N}, not a candidate: "
                          f"{str(exc).splitlines()[0][:200]}")
            out[name] = {"mere": None, "time_us": None}
    return out


def build_layer_plan(x: torch.Tensor, w: torch.Tensor, backends: dict[str, GemmBackend], *, timer: Timer,
                     mere_threshold: float, min_speedup: float,
                     forward_mere: Optional[dict[str, float]] = None, seed: int = 0,
                     timing_cache: Optional[TimingCache] = None,
                     zero_floor: float = DEFAULT_ZERO_FLOOR) -> LayerPlan:
    """Measure and choose all three GEMMs of one Linear: x (M, K) its real input, w (N, K) its weight.

    The output gradient dy (M, N) is not known before training: it is drawn N(0, 1) with a fixed seed, so
    input_grad / weight_grad MERE are "normal-input" estimates (the forward MERE uses the real x, or the
    probe's ``forward_mere`` when given). ``timing_cache``: see ``measure_gemm``.
    """
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(x.shape[0], w.shape[0], generator=gen).to(device=x.device, dtype=x.dtype)
    plan = LayerPlan(M=x.shape[0], K=x.shape[1], N=w.shape[0])
    for gemm in GEMMS:
        cands = measure_gemm(gemm, x, w, dy, backends, timer=timer,
                             known_mere=forward_mere if gemm == "forward" else None, timing_cache=timing_cache,
                             zero_floor=zero_floor)
        bf16_t = cands.get(BASELINE, {}).get("time_us")
        choice = select_backend(cands, bf16_t, mere_threshold=mere_threshold, min_speedup=min_speedup)
        setattr(plan, gemm, GemmChoice(backend=choice, mere=cands.get(choice, {}).get("mere"),
                                       time_us=cands.get(choice, {}).get("time_us"), bf16_time_us=bf16_t,
                                       candidates=cands))
    return plan
