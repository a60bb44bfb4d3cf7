"""What convert_to_loka and LoKAConfig refuse, in one line, before the model changes: inputs they cannot convert,
settings of the wrong type, typos in a model's own BF16 declarations."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.kernels.linear import LoKALinear
from tests.kernels.test_convert import DeclaresBF16, TinyModel, _batch


@pytest.mark.parametrize("globs, error", [
    ("2", r"DeclaresBF16.loka_keep_bf16: must be a tuple of globs, got '2' \(a one-glob tuple needs its comma"),
    (("mlp.7",), r"DeclaresBF16.loka_keep_bf16: 'mlp.7' names no Linear of the model"),
])
def test_a_loka_keep_bf16_typo_is_refused_in_one_line(monkeypatch, globs, error):
    from loka_trainer.dispatch.targets import declared_bf16
    monkeypatch.setattr(DeclaresBF16, "loka_keep_bf16", globs, raising=False)
    with pytest.raises(ValueError, match=error):
        declared_bf16(DeclaresBF16())


@pytest.mark.parametrize("field, value, error", [
    ("exclude", "2*", r"LoKAConfig.exclude: must be a list of strings or None, got str '2\*'"),
    ("backends", ["bf16", 8], r"LoKAConfig.backends: must be a list of strings or None, got list"),
    ("mere_threshold", "0.1", r"LoKAConfig.mere_threshold: must be a number, got str '0.1'"),
    ("timing_rounds", 2.0, r"LoKAConfig.timing_rounds: must be an integer, got float 2.0"),
    ("plan", 123, r"LoKAConfig.plan: must be a path or None, got int 123"),
    ("mods", "yes", r"LoKAConfig.mods: must be True or False, got str 'yes'"),
])
def test_a_loka_config_field_of_the_wrong_type_is_named_in_one_line(field, value, error):
    from loka_trainer import LoKAConfig
    with pytest.raises(ValueError, match=error):
        LoKAConfig(**{field: value}).validate()


@pytest.mark.parametrize("field, value, error", [
    ("min_speedup", float("inf"), r"LoKAConfig.min_speedup: must be a finite number > 0, got inf"),
    ("mere_threshold", float("inf"), r"LoKAConfig.mere_threshold: must be a finite number > 0, got inf"),
    ("mere_threshold", float("nan"), r"LoKAConfig.mere_threshold: must be a finite number > 0, got nan"),
    ("max_flushed_fraction", -0.5, r"LoKAConfig.max_flushed_fraction: must be within \[0, 1\] \(1 turns"),
])
def test_a_selection_setting_that_the_written_plan_could_not_hold_is_refused(field, value, error):
    """The plan Dispatch writes records these settings and is loaded again (``DispatchPlan.from_dict``): a value
    that the plan refuses is refused with the config, not after the model was built and measured."""
    from loka_trainer import LoKAConfig
    from loka_trainer.dispatch.plan import DispatchPlan
    with pytest.raises(ValueError, match=error):
        LoKAConfig(**{field: value}).validate()
    with pytest.raises(ValueError, match=f"'{field}' must be"):
        DispatchPlan.from_dict({"version": 1, "layers": {}, field: value})


def test_a_plan_path_that_is_a_directory_says_so(tmp_path):
    from loka_trainer import LoKAConfig
    with pytest.raises(ValueError, match=r"LoKAConfig.plan: '.*' is not a file"):
        LoKAConfig(plan=tmp_path).validate()


@pytest.mark.parametrize("case, error", [
    ("bare_linear", r"a bare nn.Linear has no parent.*nn.Sequential\(linear\)"),
    ("run_dir_is_a_file", r"run_dir '.*plan.txt' cannot hold the plan: .*plan.txt is not a directory"),
    ("plan_settings_without_dispatch", r"LoKAConfig.dispatch is False, so nothing reads exclude, backends"),
    ("no_config", r"config must be a LoKAConfig, got NoneType"),
])
def test_what_convert_to_loka_cannot_do_is_refused_in_one_line_before_the_model_changes(tmp_path, case, error):
    from loka_trainer import LoKAConfig, convert_to_loka

    (tmp_path / "plan.txt").write_text("mine")
    model = nn.Linear(64, 64) if case == "bare_linear" else TinyModel()
    config = LoKAConfig(compute_dtype="float32", timing_repeats=1, timing_rounds=1, min_speedup=0.001,
                        dispatch=case != "plan_settings_without_dispatch")
    if case == "plan_settings_without_dispatch":
        config.exclude, config.backends = ["mlp.0"], ["scaled_mm_rowwise"]
    before = repr(model)
    with pytest.raises((ValueError, TypeError), match=error):
        convert_to_loka(model, None if case == "no_config" else config, calibration_batch=_batch(), device="cpu",
                        run_dir=tmp_path / "plan.txt" if case == "run_dir_is_a_file" else tmp_path,
                        log=lambda s: None)
    assert repr(model) == before and (tmp_path / "plan.txt").read_text() == "mine"


@pytest.mark.parametrize("batch, got", [(torch.randn(16, 31), r"shape \(16, 31\)"),
                                        ({"x": torch.randn(16, 64)}, "a dict")])
def test_a_calibration_batch_the_model_does_not_take_is_named_in_one_line(batch, got):
    from loka_trainer import LoKAConfig, convert_to_loka
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with pytest.raises(ValueError, match=rf"calibration_batch: Linear '0' got {got}, expected a tensor \(\.\.\., 64\)"):
        convert_to_loka(model, LoKAConfig(timing_repeats=1, timing_rounds=1), calibration_batch=batch, device="cpu",
                        log=lambda s: None)
    assert all(type(m) is nn.Linear for m in model if isinstance(m, nn.Linear))


def test_a_shared_linear_and_a_linear_the_batch_never_reaches_stay_bf16_and_are_named():
    from loka_trainer import LoKAConfig, convert_to_loka

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            tied = nn.Linear(64, 64)
            self.a, self.b, self.c, self.unused = tied, nn.Linear(64, 64), tied, nn.Linear(64, 64)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    model, logs = Model(), []
    config = LoKAConfig(compute_dtype="float32", timing_repeats=1, timing_rounds=1, min_features=16,
                        min_speedup=1e-6, backends=["scaled_mm_tensorwise"])
    plan = convert_to_loka(model, config, calibration_batch=torch.randn(32, 64), device="cpu", log=logs.append)
    assert set(plan.layers) == {"b"} and type(model.b) is LoKALinear
    assert type(model.a) is nn.Linear and model.a is model.c  # not converted at one place and kept at the other
    assert any("1 Linear module(s) used at several places stay BF16" in line and "a = c" in line for line in logs)
    assert any("1 target Linear(s) the calibration batch's forward did not reach stay BF16: unused" in line
               for line in logs)


def test_a_backend_named_that_this_device_lacks_is_refused_not_planned_as_bf16():
    from loka_trainer import LoKAConfig, convert_to_loka
    from loka_trainer.kernels.backends import BACKENDS, available_backends
    missing = sorted(set(BACKENDS) - set(available_backends(torch.device("cpu"))))
    if not missing:
        pytest.skip("every backend runs on this CPU")
    model = TinyModel()
    with pytest.raises(ValueError, match=rf"LoKAConfig.backends: \['{missing[0]}'\] not available on cpu here"):
        convert_to_loka(model, LoKAConfig(backends=[missing[0]], timing_repeats=1, timing_rounds=1),
                        calibration_batch=_batch(), device="cpu", log=lambda s: None)
    assert type(model.mlp[0]) is nn.Linear
