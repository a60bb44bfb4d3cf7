"""Dispatch: measure each candidate backend per layer and GEMM, then pick by the LoKA rule.

Rule (paper III-C): keep candidates with MERE < threshold and speedup over BF16 > min_speedup at the layer's
real shape on this device; the fastest wins; otherwise BF16. MERE is ``probe.mere.mere`` (the Probe's too). ``select_backend`` is that rule alone,
a pure function of injected numbers; ``measure_gemm`` produces the numbers; ``build_layer_plan`` joins them.
"""
from __future__ import annotations

import gc
import statistics
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

from loka_trainer.kernels.backend_base import GemmBackend
from loka_trainer.kernels.backends import BASELINE
from loka_trainer.probe.mere import DEFAULT_ZERO_FLOOR, mere
from loka_trainer.kernels.plan import GEMMS, GemmChoice, LayerPlan
from loka_trainer.kernels.triton_quant import triton_importable

Timer = Callable[[Callable[[], object]], float]  # fn -> median time in µs
# (backend, gemm, M, K, N, dtype) -> µs: a GEMM's time depends on its shape, not its values, so layers of one
# shape (e.g. the N identical blocks of a model) are timed once per plan and get the same timings.
TimingCache = dict[tuple[str, str, int, int, int, str], float]


def select_backend(candidates: dict[str, dict[str, Optional[float]]], bf16_time_us: Optional[float], *,
                   mere_threshold: float, min_speedup: float) -> str:
    """Pick one GEMM's backend: candidates maps name -> {"mere": float|None, "time_us": float|None}.

    A candidate qualifies when its MERE < mere_threshold and bf16_time_us / time_us > min_speedup; unknown
    numbers disqualify. The fastest qualifying candidate wins; none -> "bf16".
    """
    best, best_time = BASELINE, None
    for name, c in candidates.items():
        err, t = c.get("mere"), c.get("time_us")
        if name == BASELINE or err is None or t is None or bf16_time_us is None or t <= 0:
            continue
        if err < mere_threshold and bf16_time_us / t > min_speedup and (best_time is None or t < best_time):
            best, best_time = name, t
    return best


def select_mods_mode(times_us: dict[str, Optional[float]], is_fp8: dict[str, bool], *,
                     min_speedup: float) -> tuple[str, Optional[float]]:
    """Pick a fused Mods layer's forward mode (or input-grad backend) from measured times (µs; None = failed):
    the fastest BF16 option, unless an FP8 one in ``is_fp8`` (only offered where it passed the accuracy test) is
    more than ``min_speedup`` × faster than it. Returns (choice, speedup over the fastest BF16 option)."""
    def fastest(fp8: bool) -> Optional[str]:
        ok = [m for m, t in times_us.items() if t is not None and t > 0 and is_fp8[m] == fp8]
        return min(ok, key=lambda m: times_us[m], default=None)

    bf16, fp8 = fastest(False), fastest(True)
    if bf16 is None:
        raise ValueError(f"select_mods_mode: no BF16 mode was measured: {times_us}")
    if fp8 is not None and times_us[bf16] / times_us[fp8] > min_speedup:
        return fp8, times_us[bf16] / times_us[fp8]
    return bf16, 1.0


def wall_clock_timer(repeats: int = 5, warmup: int = 1) -> Timer:
    """A timer for CPU: median wall-clock µs of ``repeats`` calls after ``warmup`` calls."""
    def timer(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    return timer


def cuda_timer() -> Timer:
    """A timer for GPUs: triton's ``do_bench`` median (ms -> µs); falls back to synchronized wall clock."""
    try:
        from triton.testing import do_bench
    except ImportError:
        wall = wall_clock_timer(repeats=20, warmup=3)
        return lambda fn: wall(lambda: (fn(), torch.cuda.synchronize()))
    return lambda fn: 1e3 * float(do_bench(fn, warmup=5, rep=20, return_mode="median"))


def cuda_graph_us(fn: Callable[[], object], rep_ms: int = 20,
                  grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> float:
    """GPU µs of one call of ``fn`` from CUDA-graph replay (triton's ``do_bench_cudagraph`` median), after one
    call outside the capture (autotuning, lazy initialization, weight caches). ``grad_to_none``: leaf tensors
    whose ``.grad`` is reset before every call (as ``zero_grad(set_to_none=True)`` does), so a backward writes
    fresh gradients instead of adding into the last call's. Raises when ``fn`` cannot be captured.

    NOTE: ``gc.collect()`` after the first call. A reference cycle made during a first call (an exception
    caught inside Triton's autotuner, a lazy import) keeps that call's autograd graph alive until the
    collector runs, and with it the AccumulateGrad nodes of the leaves, created on the default stream: a
    backward captured on the side stream then invalidates the capture (seen on the H200 at the figure-13
    shape (7680, 256) and a 4096-row MLP stack, with torch's "AccumulateGrad node's stream does not match"
    warning).
    """
    from triton.testing import do_bench_cudagraph  # lazy: absent on CPU machines

    fn()
    gc.collect()
    torch.cuda.synchronize()
    return 1e3 * float(do_bench_cudagraph(fn, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))


def cuda_graph_timer(fallback: Optional[Timer] = None) -> Timer:
    """A timer for GPUs: ``cuda_graph_us``; a call that cannot be captured is timed by ``fallback`` (default
    ``cuda_timer()``) with a warning.

    Why not ``cuda_timer``: event timing of single calls also counts the host's launch work whenever the host is
    slower than the kernels, and our FP8 paths run two or three Python-level custom ops per GEMM (~0.1–0.25 ms of
    host time each in the H200 profiles of docs/results.md). That is the likely reason a plan timed a fused Mods
    layer's FP8 forward at 554 µs against 411 µs for BF16 (8192×4096×4096) while timing the same FP8 GEMM, both
    quantizations included, at 270 µs against 343 µs. A compiled, GPU-bound training step hides host time, which
    argues for comparing GPU time (``precision.gpu_timer=cuda_graph``).
    """
    eager = fallback or cuda_timer()
    if not triton_importable():
        return eager

    def timer(fn: Callable[[], object]) -> float:
        try:
            return cuda_graph_us(fn)
        except Exception as exc:  # noqa: BLE001 -- any capture failure: time it without a graph instead
            torch.cuda.synchronize()
            warnings.warn(f"dispatch: CUDA-graph capture failed ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}); timed without a graph instead")
            return eager(fn)
    return timer


# ``precision.gpu_timer`` / ``precision.layer_timer`` -> how Dispatch times GEMM candidates / a fused Mods layer's
# whole step on a GPU. "cuda_events" (the GEMMs' default) is what the recorded plans used; "cuda_graph" is GPU time
# without host cost (``cuda_graph_timer``). End to end on the H200 (Wukong, docs/results.md §2b) the graph-timed
# plan chose more FP8 GEMMs and trained 1.8% slower. A fused layer's eager step is host-bound, though: 680-1470 µs
# by events (six repeats of one step spread by up to 75%) for 32-91 µs of GPU time at batch 4096, whose
# graph-replay repeats agree within 2% (H200, docs/kernels/README.md, tenth round). So layer choices are timed by
# graph replay unless ``layer_timer`` says otherwise.
GPU_TIMERS: dict[str, Callable[[], Timer]] = {"cuda_events": cuda_timer, "cuda_graph": cuda_graph_timer}


def default_timer(device: torch.device | str, gpu_timer: str = "cuda_events") -> Timer:
    """``GPU_TIMERS[gpu_timer]`` on CUDA, wall clock elsewhere."""
    return GPU_TIMERS[gpu_timer]() if torch.device(device).type == "cuda" else wall_clock_timer()


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
                     timing_cache: Optional[TimingCache] = None, zero_floor: float = DEFAULT_ZERO_FLOOR) -> LayerPlan:
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
