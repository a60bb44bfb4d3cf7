"""Dispatch's choice: the LoKA rule as pure functions of measured numbers (MERE, µs).

Rule (paper III-C): keep candidates with MERE < threshold and speedup over BF16 > min_speedup at the layer's
real shape on this device; the fastest wins; otherwise BF16.
"""
from __future__ import annotations

from typing import Optional

from loka_trainer.kernels.backends import BASELINE


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
