"""The offline command end to end on CPU: stats from a plain loop -> report.json / .md / .png."""
from __future__ import annotations

import json

import pytest

from loka_trainer.callbacks.probe import ProbeCallback
from loka_trainer.probe.report import main

from .test_callback_probe import run_plain_loop


@pytest.fixture(scope="module")
def stats_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "probe"
    run_plain_loop(ProbeCallback(interval=2, save_interval=100, out_dir=str(out), tensorboard=False), steps=6)
    return out


def test_report_command_writes_the_dispatch_contract(stats_dir, capsys):
    assert main([str(stats_dir), "--num-samples", "2", "--device", "cpu", "--threshold", "0.3"]) == 0
    report = json.loads((stats_dir / "report.json").read_text())
    assert set(report) == {"version", "device", "num_samples", "threshold", "min_speedup", "layers"}
    assert report["version"] == 1 and report["num_samples"] == 2 and report["threshold"] == 0.3
    assert set(report["layers"]) == {"inner.0", "inner.2", "head"}
    layer = report["layers"]["inner.0"]
    assert layer["shape"] == {"M": 16, "K": 8, "N": 32}
    assert layer["representation"].startswith("activation:full")
    for name, c in layer["candidates"].items():
        assert set(c) == {"mere", "mere_normal", "speedup", "unsafe", "not_worth_it"}
        assert c["unsafe"] == (c["mere"] >= 0.3)
        assert c["not_worth_it"] == (c["speedup"] is None or c["speedup"] <= report["min_speedup"])
    bf16 = layer["candidates"]["bf16"]
    assert bf16["speedup"] == 1.0 and 0 < bf16["mere"] < 0.05  # bf16 rounding only
    table = (stats_dir / "report.md").read_text()
    assert "| inner.0 | 16x8x32 |" in table
    assert (stats_dir / "report.png").stat().st_size > 1000


def test_report_restricted_backends_and_bad_input(stats_dir, tmp_path, capsys):
    assert main([str(stats_dir), "--num-samples", "1", "--backends", "bf16", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert all(set(layer["candidates"]) == {"bf16"} for layer in report["layers"].values())
    (tmp_path / "stats.pt").write_bytes(b"junk")
    assert main([str(tmp_path)]) == 2
    assert "invalid probe stats file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--backends"):
        main([str(stats_dir), "--backends", "no_such_kernel"])
