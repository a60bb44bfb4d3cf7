from __future__ import annotations

import pytest

from loka_trainer.bench.metrics import derive, icicle_values, lookup_peak, sum_children


def test_peaks_known_and_unknown_devices():
    assert lookup_peak("NVIDIA H200").flops["bf16"] == 989e12
    assert lookup_peak("NVIDIA H100 80GB HBM3").bytes_per_s == 3.35e12
    assert lookup_peak("CPU") is None and lookup_peak("NVIDIA H100 PCIe") is None


def test_derive_mfu_against_stated_peak():
    peak = lookup_peak("NVIDIA H200")
    out = derive({"latency_fwd_ms": 2.0, "flops_fwd": 989e9, "bytes_moved": 4.8e9}, peak=peak,
                 compute_dtype="bf16", judged_by="compute")
    assert out["tflops"] == pytest.approx(989e9 / 2e-3 / 1e12)
    assert out["mfu_pct"] == pytest.approx(50.0) and out["peak_tflops"] == pytest.approx(989.0)
    assert out["bw_util_pct"] == pytest.approx(50.0)


@pytest.mark.parametrize("device,dtype,judged", [("CPU", "bf16", "compute"), ("NVIDIA H200", "fp32", "compute"),
                                                  ("NVIDIA H200", "bf16", "bandwidth")])
def test_mfu_is_na_without_a_peak_or_for_bandwidth_modules(device, dtype, judged):
    out = derive({"latency_fwd_ms": 1.0, "flops_fwd": 1e9}, peak=lookup_peak(device), compute_dtype=dtype,
                 judged_by=judged)
    assert out["mfu_pct"] is None and out["tflops"] == pytest.approx(1.0)  # 1 GFLOP in 1 ms


def test_sum_children_none_when_a_child_lacks_a_value():
    out = sum_children([{"latency_fwd_ms": 1.0, "flops_fwd": 2.0}, {"latency_fwd_ms": 3.0}])
    assert out["latency_fwd_ms"] == 4.0 and out["flops_fwd"] is None


def test_icicle_values_never_below_sum_of_children():
    # 0 -> (1, 2), 1 -> (3,); the parent latency 1.0 is smaller than its children's 2.5 + 0.5.
    values = icicle_values([1.0, 2.0, 0.5, None], [[1, 2], [3], [], []], floor=0.01)
    assert values[3] == 0.01 and values[1] == 2.0
    assert values[0] >= values[1] + values[2]
