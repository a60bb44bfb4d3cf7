"""Dispatch's flush guard: an FP8 candidate that casts most of a layer's real input to zero is not chosen, however
low its MERE (the dense-outlier input of docs/results/outliers_cpu)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.dispatch.build import build_plan
from loka_trainer.dispatch.config import LoKAConfig
from loka_trainer.dispatch.measure import build_layer_plan
from loka_trainer.dispatch.plan import load_plan, save_plan
from loka_trainer.dispatch.plan_table import bf16_reason, format_plan_table
from loka_trainer.kernels.backends import available_backends, get_backend

TENSORWISE = "scaled_mm_tensorwise"
M, K, N = 256, 16, 64  # the first dense Linear of the outlier study: 16 dense features in, 64 out


def outlier_inputs(seed: int = 0) -> torch.Tensor:
    """(M, K) dense-feature-like inputs: |N(0, 1)|, 2 channels always 100x, rare (1e-3) values spiked 1e3x, one of
    them in a hot channel (so the batch's amax is a spiked hot value, as in a batch of the study's data)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).abs()
    x[:, [2, 11]] *= 100.0
    x[torch.rand(M, K, generator=gen) < 1e-3] *= 1e3
    x[7, 2] = 2.0 * 100.0 * 1e3
    return x


def gaussian_inputs(seed: int = 0) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed))


class OneLayer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(K, N)

    def forward(self, x):
        return self.fc(x)


def _plan(inputs: torch.Tensor, backends: list[str], **overrides):
    """Dispatch's plan of the one layer on ``inputs`` on CPU, where no FP8 GEMM is faster than BF16: min_speedup
    0.001 makes every accurate candidate win, so only the accuracy test decides; MERE threshold 0.5 (element-wise
    MERE of FP8 GEMMs on N(0, 1) operands, e.g. the drawn dy, is ~0.15-0.25), so only the flush guard rejects."""
    model = OneLayer()
    config = LoKAConfig(mods=False, backends=backends, min_speedup=0.001, min_features=16, timing_repeats=1,
                        timing_rounds=1, mere_threshold=0.5, **overrides).validate()
    return build_plan(model, {"fc": model.fc}, config=config, device="cpu", calibration_batch=inputs)


def test_a_tensorwise_kernel_is_not_chosen_for_an_input_it_flushes():
    plan = _plan(outlier_inputs(), [TENSORWISE])
    lp = plan.layers["fc"]
    # the two GEMMs reading x stay BF16, for flushing; the input grad reads only W and dy and may run FP8
    assert lp.forward.backend == lp.weight_grad.backend == "bf16"
    forward = lp.forward.candidates[TENSORWISE]
    assert forward["mere"] < LoKAConfig().mere_threshold  # MERE alone accepts it: the outputs are outlier-dominated
    assert forward["flushed"] > 0.2
    for gemm in (lp.forward, lp.weight_grad):
        assert bf16_reason(gemm, mere_threshold=plan.mere_threshold, min_speedup=plan.min_speedup,
                           max_flushed_fraction=plan.max_flushed_fraction) == "flushed"
    assert lp.input_grad.backend == TENSORWISE
    table = format_plan_table(plan)
    assert f"rejected, flushed > {plan.max_flushed_fraction}: {TENSORWISE}" in table
    assert "2 (the others flush > 0.01 of an operand to zero)" in table


def test_the_same_layer_with_gaussian_inputs_may_run_tensorwise():
    lp = _plan(gaussian_inputs(), [TENSORWISE]).layers["fc"]
    assert set(lp.backends().values()) == {TENSORWISE}
    assert lp.forward.flushed < 1e-3 and lp.weight_grad.flushed < 1e-3


def test_the_guard_can_be_turned_off():
    assert _plan(outlier_inputs(), [TENSORWISE], max_flushed_fraction=1.0).layers["fc"].forward.backend == TENSORWISE


def test_rowwise_wins_where_tensorwise_flushes_even_when_tensorwise_is_faster():
    def timer(fn):  # tensorwise fastest, rowwise next, BF16 slowest (_gemm_call's lambda captures the backend first)
        return {"bf16": 100.0, "scaled_mm_rowwise": 70.0, TENSORWISE: 50.0}[fn.__closure__[0].cell_contents.name]

    backends = {k: v for k, v in available_backends("cpu").items() if k in ("bf16", "scaled_mm_rowwise", TENSORWISE)}
    x = outlier_inputs().to(torch.bfloat16)
    w = OneLayer().fc.weight.detach().to(torch.bfloat16)
    lp = build_layer_plan(x, w, backends, timer=timer, mere_threshold=0.5, min_speedup=1.05)
    assert lp.forward.backend == lp.weight_grad.backend == "scaled_mm_rowwise"
    assert lp.input_grad.backend == TENSORWISE  # W is Gaussian: one scale per tensor keeps it
    # xᵀ rowwise is one scale per input channel: only a spiked channel loses its smallest values
    assert lp.weight_grad.candidates["scaled_mm_rowwise"]["flushed"] < 0.01
    unguarded = build_layer_plan(x, w, backends, timer=timer, mere_threshold=0.5, min_speedup=1.05,
                                 max_flushed_fraction=1.0)
    assert unguarded.forward.backend == TENSORWISE  # what MERE alone picks


def test_the_plan_with_its_flush_evidence_round_trips(tmp_path):
    plan = _plan(outlier_inputs(), [TENSORWISE, "scaled_mm_rowwise"])
    back = load_plan(save_plan(plan, tmp_path / "dispatch_plan.json"))
    assert back.to_dict() == plan.to_dict()
    assert back.layers["fc"].forward.candidates[TENSORWISE]["flushed"] > 0.2
    assert back.layers["fc"].forward.backend != TENSORWISE
    assert format_plan_table(back) == format_plan_table(plan)


@pytest.mark.parametrize("name", ["scaled_mm_tensorwise", "torchao_tensorwise", "fbgemm_tensorwise"])
def test_every_tensorwise_backend_declares_one_scale_for_the_input(name):
    a, _ = get_backend(name).operand_scaling("forward")
    assert a.granularity == "tensorwise" and a.dtype == torch.float8_e4m3fn


def test_a_fused_dgrad_that_flushes_too_much_is_not_timed():
    from loka_trainer.dispatch.build import fused_input_grad_candidates
    from loka_trainer.dispatch.plan import GemmChoice, LayerPlan

    evidence = {"mere": 0.01, "flushed": 0.5, "time_us": 9.0}
    lp = LayerPlan(M=32, K=64, N=512, input_grad=GemmChoice("bf16", candidates={"scaled_mm_rowwise": evidence}))
    assert fused_input_grad_candidates(lp, 0.2) == ["bf16"]
    assert fused_input_grad_candidates(lp, 0.2, max_flushed_fraction=1.0) == ["bf16", "scaled_mm_rowwise"]
