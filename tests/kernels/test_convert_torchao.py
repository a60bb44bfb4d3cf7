"""Uniform torchao FP8 (``precision.fp8_recipe``): which Linears it converts (targets, its own size filter,
unaligned input rows, a compiled part), and its high-precision weight-gradient recipe under CPU autocast."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.precision import PrecisionConfig, apply_precision
from tests.kernels.test_convert import TinyModel, _batch


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_uniform_torchao_converts_targets_only(recipe):
    from torchao.float8.float8_linear import Float8Linear
    m = TinyModel()
    apply_precision(m, config=PrecisionConfig(name=f"fp8_{recipe}", fp8_recipe=recipe), device="cpu",
                    log=lambda s: None)
    assert isinstance(m.mlp[0], Float8Linear) and isinstance(m.mlp[2], Float8Linear)
    assert type(m.head) is nn.Linear and type(m.mlp[4]) is nn.Linear
    assert m.mlp[0].config.emulate  # CPU: torchao's fp32 matmul, not oneDNN's FP8 reference loop
    m(_batch()).sum().backward()
    assert torch.isfinite(m.mlp[0].weight.grad).all()


@pytest.mark.parametrize("recipe,converted", [
    ("tensorwise", {"wide_k", "wide_n"}),  # skipped: K <= 4096 and N <= 1024
    ("rowwise", {"wide_n"}),  # skipped: N <= 2048 (wide_k), or N <= 4096 with K <= 2048 (small)
])
def test_torchao_auto_filter_keeps_the_shapes_torchao_finds_slower_in_bf16(recipe, converted):
    """precision.fp8_filter=auto: torchao's own size thresholds per recipe; "all" converts every target."""
    from torchao.float8.float8_linear import Float8Linear

    def model():
        return nn.ModuleDict({"small": nn.Linear(512, 512), "wide_k": nn.Linear(4112, 1024),
                              "wide_n": nn.Linear(1040, 4112)})

    for fp8_filter, want in (("auto", converted), ("all", {"small", "wide_k", "wide_n"})):
        m, logs = model(), []
        apply_precision(m, config=PrecisionConfig(name=f"fp8_{recipe}", fp8_recipe=recipe, fp8_filter=fp8_filter),
                        device="cpu", log=logs.append)
        assert {fqn for fqn, mod in m.items() if isinstance(mod, Float8Linear)} == want
        assert f"on {len(want)} Linear(s) (fp8_filter={fp8_filter})" in logs[-1]


def test_uniform_torchao_keeps_linears_with_unaligned_input_rows_high_precision():
    from torchao.float8.float8_linear import Float8Linear

    class SeedQuery(TinyModel):  # mlp.2 also runs on 2 learned seed rows: M = 2 there
        def __init__(self):
            super().__init__()
            self.seeds = nn.Parameter(torch.randn(2, 128))

        def forward(self, batch):
            return super().forward(batch) + self.mlp[2](self.seeds).sum()

    m, logs = SeedQuery(), []
    apply_precision(m, config=PrecisionConfig(name="fp8_rowwise", fp8_recipe="rowwise"), device="cpu",
                    calibration_batch=_batch(), log=logs.append)
    assert isinstance(m.mlp[0], Float8Linear) and type(m.mlp[2]) is nn.Linear
    assert any("mlp.2 (M=[2, 64])" in line for line in logs)


def test_torchao_high_precision_weight_gradient_trains_under_cpu_autocast():
    """rowwise_with_gw_hp under BF16 CPU autocast: an FP32 input (mlp.0's, from the embedding sum) and the BF16
    output gradient meet in its weight-gradient GEMM."""
    from torchao.float8.float8_linear import Float8Linear

    m = TinyModel()
    apply_precision(m, config=PrecisionConfig(name="fp8_rowwise_gw_hp", compute_dtype="bfloat16",
                                              fp8_recipe="rowwise_with_gw_hp"),
                    device="cpu", calibration_batch=_batch(), log=lambda s: None)
    assert isinstance(m.mlp[0], Float8Linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m(_batch()).float()
    logits.sum().backward()
    assert m.mlp[0].weight.grad is not None and torch.isfinite(m.mlp[0].weight.grad).all()


@pytest.mark.parametrize("recipe, device, hooked", [("rowwise_with_gw_hp", "cpu", True),
                                                    ("rowwise_with_gw_hp", "cuda", False), ("rowwise", "cpu", False)])
def test_only_a_cpu_models_high_precision_weight_gradient_recipe_casts_its_input_under_cpu_autocast(recipe, device,
                                                                                                     hooked):
    """torchao casts the input itself under CUDA autocast, and a recipe whose every GEMM is scaled takes any dtype."""
    from torchao.float8.float8_linear import Float8Linear

    m = TinyModel()
    apply_precision(m, config=PrecisionConfig(name="torchao", compute_dtype="bfloat16", fp8_recipe=recipe),
                    device=device, calibration_batch=_batch(), log=lambda s: None)
    converted = [mod for mod in m.modules() if isinstance(mod, Float8Linear)]
    assert converted and all(bool(mod._forward_pre_hooks) is hooked for mod in converted)


def test_torchao_converts_a_compiled_submodules_linears_named_as_the_models_own():
    """``model.mlp = torch.compile(model.mlp)``: ``exclude`` names ``mlp.2``, not ``mlp._orig_mod.2``, and the
    Linears inside the wrapper are converted (with the CPU autocast input cast of a high-precision weight grad)."""
    from torchao.float8.float8_linear import Float8Linear

    m = TinyModel()
    m.mlp = torch.compile(m.mlp, backend="eager")
    apply_precision(m, config=PrecisionConfig(name="torchao", compute_dtype="bfloat16", fp8_recipe="rowwise_with_gw_hp",
                                              exclude=["mlp.2"]), device="cpu", log=lambda s: None)
    inner = m.mlp._orig_mod
    assert isinstance(inner[0], Float8Linear) and bool(inner[0]._forward_pre_hooks) and type(inner[2]) is nn.Linear
