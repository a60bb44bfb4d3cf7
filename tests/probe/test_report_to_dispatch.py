"""Probe -> report -> Dispatch, as docs/api.md chains them: the report's forward MERE is what Dispatch uses, and a
report that does not fit the model is refused in one line (train.py: before anything starts)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from loka_trainer import LoKAConfig, ProbeCallback, TrainState, convert_to_loka
from loka_trainer.dispatch.probe_report import ReportedLayer, read_probe_report, report_mismatch
from loka_trainer.probe.report import main as report_main
from tests.launch import run_train


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def learn_probe_stats(model: nn.Module, opt: torch.optim.Optimizer, out, *, steps: int, interval: int) -> None:
    """Train ``model`` (x (32, 64) -> anything) on random inputs for ``steps`` steps, the Probe observing every
    ``interval``-th; its statistics are written to ``out`` at the last step."""
    probe = ProbeCallback(interval=interval, save_interval=steps, out_dir=str(out), tensorboard=False)
    state = TrainState(model=model)
    probe.on_train_start(state)
    for step in range(steps):
        state.step = step
        probe.on_step_start(state)
        model(torch.randn(32, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        probe.on_step_end(state)
    probe.on_train_end(state)


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    """Statistics of `_model` learned over 12 steps, and its report (written next to them)."""
    out = tmp_path_factory.mktemp("run") / "probe"
    model = _model()
    learn_probe_stats(model, torch.optim.Adam(model.parameters()), out, steps=12, interval=2)
    assert report_main([str(out), "--num-samples", "2", "--device", "cpu"]) == 0
    return out


def _convert(probe_stats) -> object:
    config = LoKAConfig(mods=False, probe_stats=str(probe_stats), min_features=16, min_speedup=0.001,
                        compute_dtype="float32", timing_rounds=1)
    return convert_to_loka(_model(), config, calibration_batch=torch.randn(32, 64), device=torch.device("cpu"))


@pytest.mark.parametrize("name", ["dir", "file"])
def test_dispatch_uses_the_reports_forward_mere(probe_dir, name):
    reported = read_probe_report(str(probe_dir))
    assert {fqn: (layer.k, layer.n) for fqn, layer in reported.items()} == {"0": (64, 128), "2": (128, 64)}
    plan = _convert(probe_dir if name == "dir" else probe_dir / "report.json")
    for fqn, layer in reported.items():
        cands = plan.layers[fqn].forward.candidates
        shared = layer.mere.keys() & cands.keys()
        assert len(shared) >= 2  # bf16 and at least one FP8 backend
        assert all(cands[b]["mere"] == pytest.approx(layer.mere[b]) for b in shared)


def test_a_high_reported_mere_keeps_the_forward_in_bf16(probe_dir, tmp_path):
    """The same report with every FP8 forward's MERE raised past the threshold: Dispatch keeps BF16 there."""
    report = json.loads((probe_dir / "report.json").read_text())
    for layer in report["layers"].values():
        for name, c in layer["candidates"].items():
            c["mere"] = c["mere"] if name == "bf16" else 0.9
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert {lp.forward.backend for lp in _convert(probe_dir).layers.values()} != {"bf16"}
    assert {lp.forward.backend for lp in _convert(tmp_path / "report.json").layers.values()} == {"bf16"}


def test_a_report_of_another_model_is_refused_by_convert_to_loka(probe_dir, tmp_path):
    report = json.loads((probe_dir / "report.json").read_text())
    report["layers"]["2"]["shape"]["K"] = 256
    (tmp_path / "report.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"LoKAConfig.probe_stats: .* reports 1 layer\(s\) at another shape .*"
                                         r"2 256x64 vs 128x64"):
        _convert(tmp_path / "report.json")


@pytest.mark.parametrize("content, reason", [
    ("{not json", "JSONDecodeError"),
    ('{"layers": [1, 2]}', "'layers' is not a mapping"),
    ('{"layers": {"0": {"candidates": {}}}}', "KeyError: 'shape'"),
    ('{"layers": {"0": {"shape": {"K": 64, "N": 128}, "candidates": {"fp8": {"mere": NaN}}}}}',
     "MERE not a finite number >= 0 at 0/fp8"),
])
def test_a_damaged_report_is_refused_in_one_line(tmp_path, content, reason):
    (tmp_path / "report.json").write_text(content)
    with pytest.raises(ValueError) as info:
        read_probe_report(str(tmp_path))
    assert "is not a LoKA Probe report" in str(info.value) and reason in str(info.value)
    assert "\n" not in str(info.value)


def test_report_mismatch_needs_a_shared_target_of_the_same_shape():
    reported = {"a": ReportedLayer(64, 128, {}), "b": ReportedLayer(32, 32, {})}
    assert report_mismatch(reported, {"a": (64, 128), "c": (8, 8)}) == ""
    assert report_mismatch(reported, {}) == ""  # no FP8 target: nothing to use it for
    assert "reports none of this model's 1 FP8 targets (c, ...)" in report_mismatch(reported, {"c": (8, 8)})
    assert "a 64x128 vs 64x64" in report_mismatch(reported, {"a": (64, 64)})


@pytest.mark.slow
def test_train_py_refuses_a_report_of_another_model_before_anything_starts(probe_dir, tmp_path):
    """The report of `_model` names none of Wukong's FP8 targets: one line, exit 2, no run directory."""
    run_dir = tmp_path / "run"
    proc = run_train(["model=wukong", "precision=loka", f"precision.probe_stats={probe_dir / 'report.json'}",
                      f"hydra.run.dir={run_dir}"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: precision.probe_stats:") and "reports none of this model's" in line
    assert not run_dir.exists()


def test_the_probes_statistics_file_named_as_probe_stats_says_to_make_the_report_first(tmp_path):
    """``probe_stats`` reads like the Probe's stats.pt; Dispatch reads the report made from it."""
    from loka_trainer.probe.stats_io import STATS_FILE
    torch.save({"layers": {}}, tmp_path / STATS_FILE)
    with pytest.raises(ValueError, match=r"^LoKAConfig.probe_stats: '.*stats.pt' is the Probe's statistics, not its "
                                         r"report \(run `python -m loka_trainer.probe.report STATS_DIR`"):
        LoKAConfig(probe_stats=str(tmp_path / STATS_FILE)).validate()


def test_a_report_made_with_another_zero_floor_is_refused_in_one_line(probe_dir, tmp_path):
    """Its forward MERE would have other denominators than the backward MEREs Dispatch measures beside it, all
    held to one threshold."""
    report = json.loads((probe_dir / "report.json").read_text())
    report["zero_floor"] = 0.1
    (tmp_path / "report.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match=r"^LoKAConfig.probe_stats: .* was made with --zero-floor 0.1 but Dispatch "
                                         r"measures with mere_zero_floor=0.01, .* --zero-floor 0.01`$"):
        _convert(tmp_path / "report.json")
