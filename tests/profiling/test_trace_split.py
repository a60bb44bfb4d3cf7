"""profiling.trace_split: a Chrome trace split per training step by kernel launch."""
from __future__ import annotations

import pytest

from loka_trainer.profiling.trace_split import phase, split_steps, step_ranges, summary_line


def _range(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}


def _launch(ts, correlation, cat="cuda_runtime", name="cudaLaunchKernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 5.0, "args": {"correlation": correlation}}


def _gpu(name, ts, dur, correlation, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


TRACE = {"traceEvents": [
    _range("ProfilerStep#0", 0.0, 1000.0),
    _range("ProfilerStep#1", 1000.0, 1000.0),
    _range("ProfilerStep#0", 50.0, 3000.0, cat="gpu_user_annotation"),  # the GPU span of a host range: not a step
    _range("Optimizer.step#Adam.step", 900.0, 80.0, cat="gpu_user_annotation"),
    _range(phase("forward"), 50.0, 750.0), _range(phase("backward"), 1100.0, 400.0),
    _launch(100.0, 1), _gpu("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 150.0, 400.0, 1),
    _launch(200.0, 2, cat="cuda_driver", name="cuLaunchKernelEx"), _gpu("quant_rowwise_kernel", 600.0, 100.0, 2),
    # launched at the end of step 0, run while the host is already in step 1: still step 0's
    _launch(990.0, 3), _gpu("triton_poi_fused__scaled_mm__to_copy_clamp_0", 1200.0, 50.0, 3),
    _launch(1100.0, 4, name="cudaMemcpyAsync"), _gpu("Memcpy HtoD (Pinned -> Device)", 1300.0, 30.0, 4,
                                                       cat="gpu_memcpy"),
    _launch(1150.0, 5), _gpu("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1400.0, 200.0, 5),
    _launch(1160.0, 6), _gpu("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1600.0, 100.0, 6),
    _launch(5000.0, 7), _gpu("norm_fwd_kernel", 5100.0, 10.0, 7),  # launched after the last step: not counted
]}


def test_step_ranges_are_the_host_profiler_steps():
    assert step_ranges(TRACE["traceEvents"]) == {0: (0.0, 1000.0), 1: (1000.0, 2000.0)}


def test_kernels_count_for_the_step_that_launched_them():
    first, second = split_steps(TRACE, step_offset=200)
    assert (first["step"], second["step"]) == (200, 201)
    assert first["wall_ms"] == pytest.approx(1.0) and second["wall_ms"] == pytest.approx(1.0)
    assert first["gemm_ms"] == pytest.approx(0.4)
    assert first["quantization_ms"] == pytest.approx(0.1)
    assert first["other_ms"] == pytest.approx(0.05)  # inductor's fused kernel named after _scaled_mm is no GEMM
    assert first["gpu_ms"] == pytest.approx(0.55)
    assert second["gemm_ms"] == pytest.approx(0.3) and second["other_ms"] == pytest.approx(0.03)  # + the memcpy
    assert second["epilogue_ms"] == 0.0
    assert second["top_kernels"][0] == ["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 300.0, 2]


def test_host_and_kernel_time_split_by_the_trainers_phases():
    first, second = split_steps(TRACE)
    assert first["phases"]["forward"] == pytest.approx({"host_ms": 0.75, "gpu_ms": 0.5})
    assert first["phases"]["unnamed"] == pytest.approx({"host_ms": 0.0, "gpu_ms": 0.05})  # launched at 990 µs
    assert second["phases"]["backward"] == pytest.approx({"host_ms": 0.4, "gpu_ms": 0.33})


def test_summary_line_names_each_kind_with_time():
    first = split_steps(TRACE)[0]
    line = summary_line(first)
    assert line.startswith("profile step 0: 1.00 ms on the host (forward 0.75); GPU kernels 0.55 ms (")
    assert "gemm 0.40" in line and "quantization 0.10" in line and "epilogue" not in line


def test_an_unreadable_trace_costs_its_summary_only(tmp_path, caplog):
    """The profiler callback logs one line and keeps training when its trace cannot be split."""
    from loka_trainer.callbacks.profiler import ProfilerCallback

    class Prof:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                f.write("{not json")

    cb = ProfilerCallback(tmp_path / "trace", start_step=0, num_steps=1, summary_path=tmp_path / "profile.json")
    with caplog.at_level("WARNING"):
        cb._write_trace(Prof())
    assert not (tmp_path / "profile.json").exists()
    assert any("profile summary skipped" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "trace").glob("*.pt.trace.json"))
