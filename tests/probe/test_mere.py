from __future__ import annotations

import dataclasses

import pytest
import torch

from loka_trainer.probe.mere import DEFAULT_ZERO_FLOOR, accumulate_mere, exact_fp32_forward, mere
from loka_trainer.probe.report import analyze_layer

from .helpers import learned_layer_entry, outlier_activations

TILE = 128  # the faulty kernel looks only at the first K-tile of each row
FP8_MAX = 448.0


def test_mere_values_and_zero_guard():
    ref = torch.tensor([[1.0, -2.0], [4.0, -8.0]])
    assert float(mere(ref, ref)) == 0.0
    assert float(mere(ref * 1.1, ref)) == pytest.approx(0.1, rel=1e-5)
    # A zero reference element is counted relative to the floor (zero_floor * mean|ref|), not dropped or inf.
    ref0 = torch.tensor([0.0, 2.0])
    assert float(mere(torch.tensor([0.1, 2.0]), ref0, zero_floor=0.1)) == pytest.approx(0.1 / 0.1 / 2)
    assert float(mere(torch.zeros(3), torch.zeros(3))) == 0.0
    with pytest.raises(ValueError, match="shape"):
        mere(torch.zeros(2), torch.zeros(3))


def _fake_fp8(t: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize rows of t (R, C) to e4m3 with per-row amax (R, 1); out-of-range values saturate."""
    scale = amax.clamp_min(1e-12) / FP8_MAX
    return (t / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def rowwise_fp8(x, w):
    return _fake_fp8(x, x.abs().amax(1, keepdim=True)) @ _fake_fp8(w, w.abs().amax(1, keepdim=True)).T


def faulty_rowwise_fp8(x, w):
    """Bug: the activation row scale comes from the first K-tile only, so later outlier features saturate.
    On i.i.d. normal rows the first tile's max is close to the row max, so the bug barely shows."""
    return _fake_fp8(x, x[:, :TILE].abs().amax(1, keepdim=True)) @ _fake_fp8(w, w.abs().amax(1, keepdim=True)).T


class _Fake:
    def __init__(self, name, fn):
        self.name, self.forward = name, fn

    def supports(self, M, K, N):
        return True


def test_learned_samples_expose_a_faulty_kernel_that_normal_samples_hide():
    """The paper's table-V effect: same kernels, learned vs standard-normal operands."""
    backends = {"exact": _Fake("exact", exact_fp32_forward), "fp8_rowwise": _Fake("fp8_rowwise", rowwise_fp8),
                "faulty": _Fake("faulty", faulty_rowwise_fp8)}
    entry = analyze_layer(learned_layer_entry(), backends, num_samples=8, threshold=0.2, min_speedup=1.05,
                          device=torch.device("cpu"), timing=False)
    c = entry["candidates"]
    assert c["exact"]["mere"] == 0.0 and c["exact"]["mere_normal"] == 0.0
    assert c["faulty"]["mere"] > 5 * c["faulty"]["mere_normal"]  # learned inputs reveal the bug
    assert c["faulty"]["mere_normal"] < 2 * c["fp8_rowwise"]["mere_normal"]  # normal inputs: looks like fp8
    assert c["faulty"]["mere"] > 5 * c["fp8_rowwise"]["mere"]
    assert c["faulty"]["unsafe"] and not c["exact"]["unsafe"]
    assert entry["shape"] == {"M": 128, "K": 256, "N": 64}
    assert all(v["not_worth_it"] and v["speedup"] is None for v in c.values())  # timing off: no speedup


class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(128, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("zero_floor", [0.0, 0.05])
def test_dispatch_and_the_report_give_the_same_mere_for_the_same_operands_and_floor(zero_floor):
    """Dispatch measures its plan with ``precision.mere_zero_floor`` on the layer's BF16 input and weight; the
    report's accumulate_mere, given the same fp32 values and ``--zero-floor``, must produce the same number
    (one MERE, one floor, one reference convention: BF16-rounded operands, fp32 reference)."""
    from loka_trainer.kernels.backends import get_backend
    from loka_trainer.precision import PrecisionConfig
    from loka_trainer.dispatch.build import build_plan
    from loka_trainer.dispatch.calibration import capture_linear_inputs

    torch.manual_seed(0)
    model = _TwoLinears()
    gen = torch.Generator().manual_seed(1)
    batch = outlier_activations(64, 128, gen=gen, outliers=(3, 77)).float()
    name = "scaled_mm_tensorwise"
    config = PrecisionConfig(name="loka", compute_dtype="bfloat16", dispatch=True, backends=[name],
                             timing_repeats=1, mere_zero_floor=zero_floor)
    linears = {"fc1": model.fc1, "fc2": model.fc2}
    plan = build_plan(model, linears, config=config.validate(), device="cpu", calibration_batch=batch)
    inputs = capture_linear_inputs(model, linears, batch)
    for fqn, lin in linears.items():
        dispatch_mere = plan.layers[fqn].forward.candidates[name]["mere"]
        report_mere = accumulate_mere(iter([(inputs[fqn].float(), lin.weight.detach())]),
                                      {name: get_backend(name).forward}, zero_floor=zero_floor)[name]
        assert dispatch_mere == report_mere  # the same tensors through the same ops
    # The floor reaches Dispatch: the same layer scores differently with another floor.
    other = dataclasses.replace(config, mere_zero_floor=0.5)
    plan_other = build_plan(model, linears, config=other, device="cpu", calibration_batch=batch)
    assert (plan_other.layers["fc1"].forward.candidates[name]["mere"]
            != plan.layers["fc1"].forward.candidates[name]["mere"])


def test_zero_floor_config_is_validated():
    from loka_trainer.precision import PrecisionConfig

    assert PrecisionConfig().mere_zero_floor == DEFAULT_ZERO_FLOOR
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="precision.mere_zero_floor"):
            PrecisionConfig(mere_zero_floor=bad).validate()
