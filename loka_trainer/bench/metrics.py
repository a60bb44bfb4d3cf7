"""Pure metric math for the Component Benchmark: device peaks, TFLOP/s, MFU, bandwidth, tree estimates.

Notation: a *metrics* dict maps a column name to a float, or to None for "n/a" (never a made-up number).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

# Metrics that add up over children, so a failed parent can be estimated as the sum of its children.
ADDITIVE = ("latency_fwd_ms", "latency_fwd_bwd_ms", "flops_fwd", "flops_fwd_bwd", "param_bytes", "bytes_moved")


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Dense (not sparse-headline) peaks of one device; a dtype missing from ``flops`` has no stated peak."""

    name: str
    flops: Mapping[str, float]  # compute dtype ("bf16", "fp8", "tf32") -> FLOP/s
    bytes_per_s: float  # HBM bandwidth


# NOTE: first matching substring of torch.cuda.get_device_name() wins; order the specific names first.
# H100 PCIe / NVL have lower peaks and are deliberately absent (-> MFU n/a rather than a wrong peak).
DEVICE_PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    ("H200", DevicePeak("H200 SXM", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 495e12}, 4.8e12)),
    ("H100 80GB HBM3", DevicePeak("H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 495e12},
                                  3.35e12)),
    ("H100 SXM", DevicePeak("H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 495e12}, 3.35e12)),
)


def lookup_peak(device_name: str) -> Optional[DevicePeak]:
    """The stated peaks for a device name (e.g. ``"NVIDIA H200"``), or None when unknown (CPU included)."""
    for pattern, peak in DEVICE_PEAKS:
        if pattern in device_name:
            return peak
    return None


def _div(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den <= 0 or math.isnan(num) or math.isnan(den):
        return None
    return num / den


def derive(metrics: Mapping[str, Optional[float]], *, peak: Optional[DevicePeak], compute_dtype: str,
           judged_by: str) -> dict[str, Optional[float]]:
    """Throughput columns from measured ones.

    Returns ``tflops`` (fwd FLOPs / fwd latency), ``mfu_pct`` (vs ``peak.flops[compute_dtype]``, None when the
    peak is unknown or the module is judged by bandwidth), ``peak_tflops``, ``bw_gbps`` (bytes moved / fwd
    latency), ``bw_util_pct`` and ``peak_bw_gbps``.
    """
    seconds = _div(metrics.get("latency_fwd_ms"), 1e3)
    tflops = _div(metrics.get("flops_fwd"), seconds)
    tflops = None if tflops is None else tflops / 1e12
    peak_flops = None if peak is None else peak.flops.get(compute_dtype)
    peak_tflops = None if peak_flops is None else peak_flops / 1e12
    mfu = _div(tflops, peak_tflops)
    bw = _div(metrics.get("bytes_moved"), seconds)
    peak_bw = None if peak is None else peak.bytes_per_s
    bw_util = _div(bw, peak_bw)
    return {
        "tflops": tflops,
        "mfu_pct": None if (mfu is None or judged_by == "bandwidth") else 100.0 * mfu,
        "peak_tflops": peak_tflops,
        "bw_gbps": None if bw is None else bw / 1e9,
        "bw_util_pct": None if bw_util is None else 100.0 * bw_util,
        "peak_bw_gbps": None if peak_bw is None else peak_bw / 1e9,
    }


def sum_children(children: list[Mapping[str, Optional[float]]]) -> dict[str, Optional[float]]:
    """Estimate of a parent's additive metrics as the sum over its children; None if any child lacks one."""
    out: dict[str, Optional[float]] = {}
    for key in ADDITIVE:
        values = [c.get(key) for c in children]
        out[key] = None if (not values or any(v is None for v in values)) else float(sum(values))
    return out


def icicle_values(latency: list[Optional[float]], children: list[list[int]], floor: float) -> list[float]:
    """Icicle box sizes that are safe for plotly ``branchvalues="total"``.

    latency:  (N,) a node's own latency or None; children: (N,) child indices per node (a tree, any order).
    Returns (N,) values with value[i] >= sum(value[children]) (else plotly draws a blank chart), the measured
    latency where it already satisfies that, and ``floor`` for a childless node without a latency.
    """
    values: list[Optional[float]] = [None] * len(latency)

    def visit(i: int) -> float:
        if values[i] is None:
            kids = sum(visit(c) for c in children[i])
            own = latency[i] if latency[i] is not None and latency[i] > 0 else 0.0
            values[i] = max(own, kids, floor if not children[i] else 0.0)
        return values[i]  # type: ignore[return-value]

    for i in range(len(latency)):
        visit(i)
    return [float(v) for v in values]  # type: ignore[arg-type]
