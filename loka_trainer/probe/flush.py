"""The flushed fraction: how much of a GEMM operand an FP8 cast turns into zeros.

    flushed(x, g) = #{i : x_i ≠ 0 and q_g(x)_i = 0} / #{i : x_i ≠ 0}        (0 when x has no nonzero element)

q_g is the FP8 cast with scale granularity g (a ``kernels.quant.QUANTIZERS`` name: one scale per tensor, per row,
per 1×128 group, ...; the scale is ``quant.quantize``'s, i.e. torchao's amax-to-scale, optionally rounded down to a
power of 2 as torchao's rowwise recipes do). A value flushes when
|x · scale| is below half the smallest FP8 subnormal (2^-10 in e4m3, 2^-17 in e5m2), i.e. when it is more than
~2^17.8 (e4m3) times smaller than its group's amax: an outlier that sets the amax of a group wipes out the small
values sharing its scale.

Why a second measure beside MERE: MERE is relative to the GEMM's output. When a few large input channels dominate
every output, losing all the small channels hardly moves the output, so MERE stays low while most of the input's
information is gone (``docs/results/outliers_cpu``: one scale per tensor flushes 84% of the first dense Linear's
nonzero inputs at a forward MERE of 0.06, the lowest of the model's layers).
"""
from __future__ import annotations

from typing import Optional

import torch

from loka_trainer.kernels.quant import cast_to_fp8, expand_scale, quantize

# Dispatch's default ``max_flushed_fraction``: Gaussian-like activations lose ~1e-5 of their nonzero values even with
# one scale per tensor (amax / RMS ~ 5), and heavy tails up to amax / RMS ~ 1000 still < 0.2%; an operand whose
# scale an outlier sets loses far more (84% on the dense-outlier input above).
DEFAULT_MAX_FLUSHED_FRACTION = 0.01


@torch.no_grad()
def flushed_fraction_of(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x (any shape) high precision and q (same shape) its FP8 cast -> scalar fp32: the fraction of x's nonzero
    elements whose cast is zero (0 when x has none)."""
    if x.shape != q.shape:
        raise ValueError(f"x {tuple(x.shape)} and its cast q {tuple(q.shape)} differ in shape")
    nonzero = x != 0
    flushed = nonzero & (q.to(torch.float32) == 0)
    return flushed.sum().to(torch.float32) / nonzero.sum().clamp_min(1).to(torch.float32)


@torch.no_grad()
def fp8_cast(x: torch.Tensor, granularity: str, dtype: torch.dtype, *,
             power_of_2_scales: bool = False) -> torch.Tensor:
    """x (R, C) -> its FP8 cast q (R, C) with ``granularity`` scales (``quant.quantize``); ``power_of_2_scales``:
    each scale rounded down to a power of 2 first (torchao's ``round_scales_to_power_of_2``)."""
    q, scale_inv = quantize(x, granularity, dtype)
    if not power_of_2_scales:
        return q
    from torchao.float8.float8_utils import _round_scale_down_to_power_of_2  # noqa: PLC0415 -- torchao imports slowly

    scale = _round_scale_down_to_power_of_2(expand_scale(scale_inv, tuple(x.shape)).reciprocal())  # (R, C)
    return cast_to_fp8(x, scale, dtype)


@torch.no_grad()
def flushed_fraction(x: torch.Tensor, granularity: str, dtype: torch.dtype = torch.float8_e4m3fn, *,
                     power_of_2_scales: bool = False) -> float:
    """x (R, C): a GEMM operand in the layout its scales are taken in (rows along the contraction dim C, as
    ``kernels.backend_base`` lays out every operand) -> the fraction of its nonzero elements that the cast to
    ``dtype`` with ``granularity`` scales (``quant.QUANTIZERS``; ``power_of_2_scales``: see ``fp8_cast``) sets
    to zero."""
    return float(flushed_fraction_of(x, fp8_cast(x, granularity, dtype, power_of_2_scales=power_of_2_scales)))


@torch.no_grad()
def gemm_flushed_fraction(backend, gemm: str, operands: dict[str, torch.Tensor], *,
                          cache: Optional[dict] = None) -> Optional[float]:
    """The largest flushed fraction over ``operands`` (role "a" / "b" -> that NT operand of ``gemm``, e.g. only the
    ones whose values are known) as ``backend`` casts them (``GemmBackend.operand_scaling``); None when it declares
    no FP8 cast of any of them (a duck-typed user kernel without ``operand_scaling`` included). ``cache`` (keyed by
    GEMM, role and scaling) shares results between backends that cast alike."""
    scaling = getattr(backend, "operand_scaling", None)
    if scaling is None:
        return None
    by_role = dict(zip(("a", "b"), scaling(gemm)))
    cache = {} if cache is None else cache
    fractions = []
    for role, operand in operands.items():
        s = by_role[role]
        if s is None:
            continue
        key = (gemm, role, s)
        if key not in cache:
            cache[key] = flushed_fraction(operand, s.granularity, s.dtype, power_of_2_scales=s.power_of_2_scales)
        fractions.append(cache[key])
    return max(fractions) if fractions else None
