from __future__ import annotations

import pytest
import torch

from loka_trainer.dispatch.measure import build_layer_plan, measure_gemm
from loka_trainer.dispatch.select import select_backend
from loka_trainer.kernels.backends import available_backends, get_backend
from loka_trainer.probe.mere import mere

RULE = dict(mere_threshold=0.2, min_speedup=1.05)


def test_fastest_accurate_enough_candidate_wins():
    cands = {"bf16": {"mere": 0.003, "time_us": 100.0}, "a": {"mere": 0.05, "time_us": 80.0},
             "b": {"mere": 0.04, "time_us": 60.0}, "c": {"mere": 0.5, "time_us": 10.0}}
    assert select_backend(cands, 100.0, **RULE) == "b"  # c is faster but too inaccurate


def test_not_fast_enough_or_unknown_stays_bf16():
    cands = {"a": {"mere": 0.01, "time_us": 96.0},  # 1.04x < 1.05x
             "b": {"mere": None, "time_us": 10.0}, "c": {"mere": 0.01, "time_us": None}}
    assert select_backend(cands, 100.0, **RULE) == "bf16"
    assert select_backend({"a": {"mere": 0.01, "time_us": 50.0}}, None, **RULE) == "bf16"


@pytest.mark.parametrize("threshold,expected", [(0.2, "a"), (0.05, "bf16")])
def test_threshold_is_strict(threshold, expected):
    cands = {"a": {"mere": 0.05, "time_us": 50.0}}
    assert select_backend(cands, 100.0, mere_threshold=threshold, min_speedup=1.05) == expected


def test_dispatch_and_probe_share_one_mere():
    import importlib
    dispatch = importlib.import_module("loka_trainer.dispatch.measure")
    probe_mere = importlib.import_module("loka_trainer.probe.mere")
    assert dispatch.mere is probe_mere.mere is mere


def test_mere_floors_near_zero_reference():
    ref = torch.tensor([1.0, -2.0, 0.0, 1e-12])  # mean |ref| = 0.75 -> floor 0.0075
    out = torch.tensor([1.1, -2.0, 0.0075, 0.0])
    assert float(mere(out, ref)) == pytest.approx((0.1 + 0.0 + 1.0 + 1e-12 / 0.0075) / 4, rel=1e-5)
    assert float(mere(torch.zeros(3), torch.zeros(3))) == 0.0
    assert float(mere(torch.ones(3), torch.zeros(3))) > 1e30  # any error on an all-zero reference is huge


def test_a_backend_failing_at_a_shape_is_not_a_candidate():
    class Failing:
        def supports(self, M, K, N):
            return True

        def forward(self, x, w):
            raise RuntimeError("CUDA kernel launch failed: invalid argument")

    x, w, dy = torch.randn(32, 16), torch.randn(16, 16), torch.randn(32, 16)
    backends = {"bf16": get_backend("bf16"), "failing": Failing()}
    with pytest.warns(UserWarning, match="failing forward failed"):
        cands = measure_gemm("forward", x, w, dy, backends, timer=lambda fn: 1.0)
    assert cands["failing"] == {"mere": None, "time_us": None}
    assert select_backend(cands, cands["bf16"]["time_us"], **RULE) == "bf16"


def _fake_timer(times_by_backend):
    """Timer that reports injected times: identifies the backend by the call's closure."""
    def timer(fn):
        backend = fn.__closure__[0].cell_contents  # _gemm_call's lambda captures the backend first
        return times_by_backend[backend.name]
    return timer


def test_build_layer_plan_with_injected_timings_and_probe_mere():
    torch.manual_seed(0)
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    backends = {k: v for k, v in available_backends("cpu").items()
                if k in ("bf16", "scaled_mm_rowwise", "scaled_mm_tensorwise")}
    times = {"bf16": 100.0, "scaled_mm_rowwise": 70.0, "scaled_mm_tensorwise": 50.0}
    # The probe says tensorwise is inaccurate on this layer's real inputs: forward must skip it.
    # Threshold 0.5: element-wise MERE of FP8 on N(0,1) data is ~0.15-0.25, so timings decide the backward.
    lp = build_layer_plan(x, w, backends, timer=_fake_timer(times), forward_mere={"scaled_mm_tensorwise": 0.9},
                          mere_threshold=0.5, min_speedup=1.05)
    assert (lp.M, lp.K, lp.N) == (64, 128, 32)
    assert lp.forward.backend == "scaled_mm_rowwise"
    assert lp.input_grad.backend == "scaled_mm_tensorwise" == lp.weight_grad.backend
    assert lp.forward.candidates["scaled_mm_tensorwise"]["mere"] == 0.9
    assert lp.forward.speedup == pytest.approx(100.0 / 70.0)
    slow = {k: 200.0 for k in times} | {"bf16": 100.0}
    lp = build_layer_plan(x, w, backends, timer=_fake_timer(slow), **RULE)
    assert set(lp.backends().values()) == {"bf16"}


def test_layers_of_one_shape_are_timed_once_per_plan():
    torch.manual_seed(0)
    backends = {k: v for k, v in available_backends("cpu").items() if k in ("bf16", "scaled_mm_rowwise")}
    calls = []
    inner = _fake_timer({"bf16": 100.0, "scaled_mm_rowwise": 50.0})

    def counting(fn):
        calls.append(fn)
        return inner(fn)

    cache = {}
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    first = build_layer_plan(x, w, backends, timer=counting, timing_cache=cache, rounds=2, **RULE)
    assert len(calls) == 2 * 3 * 2  # two backends, three GEMMs, two rounds
    second = build_layer_plan(torch.randn(64, 128), torch.randn(32, 128), backends, timer=counting,
                              timing_cache=cache, rounds=2, **RULE)
    assert len(calls) == 12 and second.forward.candidates["bf16"]["times_us"] == [100.0, 100.0]  # reused
    rowwise = "scaled_mm_rowwise"
    assert second.forward.candidates[rowwise]["mere"] != first.forward.candidates[rowwise]["mere"]  # re-measured
    build_layer_plan(torch.randn(32, 128), torch.randn(32, 128), backends, timer=counting, timing_cache=cache,
                     rounds=2, **RULE)
    assert len(calls) == 24  # another M: timed again


@pytest.mark.parametrize("times,expected", [
    ({"fused_bf16": 120.0, "split_bf16": 100.0, "fused_fp8": 80.0, "split_fp8": 90.0}, ("fused_fp8", 1.25)),
    ({"fused_bf16": 120.0, "split_bf16": 100.0, "fused_fp8": 97.0, "split_fp8": None}, ("split_bf16", 1.0)),
    ({"fused_bf16": 120.0, "split_bf16": None}, ("fused_bf16", 1.0)),  # a failed mode is never picked
])
def test_mods_mode_rule(times, expected):  # one time per mode
    from loka_trainer.dispatch.select import select_mods_mode
    is_fp8 = {m: "fp8" in m for m in times}
    mode, speedup = select_mods_mode(times, is_fp8, min_speedup=1.05)
    assert (mode, speedup) == (expected[0], pytest.approx(expected[1]))


@pytest.mark.parametrize("times,expected", [
    # the FP8 mode wins 2 of 3 rounds by > 1.05x, loses one: not chosen
    ({"split_bf16": [100.0, 100.0, 100.0], "split_fp8": [80.0, 80.0, 99.0]}, "split_bf16"),
    # one BF16 round is an outlier (7892 µs): FP8 is not faster in the other rounds, so it is not chosen
    ({"split_bf16": [50.0, 7892.0, 52.0], "split_fp8": [60.0, 61.0, 59.0]}, "split_bf16"),
    # wins every round: chosen, speedup from the medians
    ({"split_bf16": [100.0, 102.0, 98.0], "split_fp8": [80.0, 81.0, 79.0]}, "split_fp8"),
])
def test_mods_mode_rule_needs_a_win_in_every_round(times, expected):
    from loka_trainer.dispatch.select import select_mods_mode
    mode, _ = select_mods_mode(times, {m: "fp8" in m for m in times}, min_speedup=1.05)
    assert mode == expected


def test_cuda_graph_timer_reports_graph_time_and_falls_back_when_capture_fails(monkeypatch):
    pytest.importorskip("triton")
    from loka_trainer import timing
    calls = []
    monkeypatch.setattr(timing, "cuda_graph_us", lambda fn: (fn(), 250.0)[1])
    timer = timing.cuda_graph_timer(fallback=lambda fn: 999.0)
    assert timer(lambda: calls.append(1)) == pytest.approx(250.0)
    assert calls == [1]

    def capture_fails(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(timing, "cuda_graph_us", capture_fails)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    timer = timing.cuda_graph_timer(fallback=lambda fn: 999.0)
    with pytest.warns(UserWarning, match="CUDA-graph capture failed .*not permitted when stream is capturing"):
        assert timer(lambda: None) == 999.0
