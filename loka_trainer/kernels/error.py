"""MERE, the one error measure of LoKA (Dispatch's accuracy filter and the Probe's offline analysis).

MERE(out, ref) = mean_ij |out_ij − ref_ij| / max(|ref_ij|, floor),  floor = zero_floor · mean_ij |ref_ij|.

Near-zero references: an output element whose exact value is ~0 has an unbounded relative error, and with
continuous inputs a fixed fraction of elements is arbitrarily close to 0, so the plain mean diverges as the
sample grows. The denominator is therefore floored at ``zero_floor`` (default 1e-2) times the mean |ref| of
the same output; such elements are counted (not dropped), with their error measured relative to the output's
typical magnitude. If all of ref is 0 the floor falls back to the smallest normal fp32, so an exact kernel
still scores 0 (and any error scores huge).
"""
from __future__ import annotations

import torch

DEFAULT_ZERO_FLOOR = 1e-2


@torch.no_grad()
def mere(out: torch.Tensor, ref: torch.Tensor, *, zero_floor: float = DEFAULT_ZERO_FLOOR) -> torch.Tensor:
    """Mean element-wise relative error. out, ref: same shape (any) -> scalar fp32 tensor."""
    if out.shape != ref.shape:
        raise ValueError(f"out {tuple(out.shape)} and ref {tuple(ref.shape)} differ in shape")
    out, ref = out.float(), ref.float()
    abs_ref = ref.abs()
    floor = (zero_floor * abs_ref.mean()).clamp_min(torch.finfo(torch.float32).tiny)
    return ((out - ref).abs() / torch.maximum(abs_ref, floor)).mean()
