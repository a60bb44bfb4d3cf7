from __future__ import annotations

import pytest
import torch

from loka_trainer.models.mods import LOKA_MODS, ModsConfig, ResolvedMods, resolve_mods

PUBLISHED = ResolvedMods(bias=True, norm="layernorm", activation="silu", block_size=256)


def test_none_means_published_without_loka():
    assert resolve_mods(ModsConfig(), published=PUBLISHED, loka_mods=False) == PUBLISHED


def test_none_means_loka_defaults_under_loka():
    resolved = resolve_mods(ModsConfig(block_size=128), published=PUBLISHED, loka_mods=True)
    assert resolved == ResolvedMods(bias=False, norm="blocknorm", activation="hardswish", block_size=128)
    assert (LOKA_MODS.bias, LOKA_MODS.norm, LOKA_MODS.activation) == (False, "blocknorm", "hardswish")


@pytest.mark.parametrize("loka_mods", [False, True])
@pytest.mark.parametrize(
    "field,value", [("bias", True), ("bias", False), ("norm", "rmsnorm"), ("norm", "none"), ("activation", "relu")]
)
def test_explicit_value_always_wins(field, value, loka_mods):
    resolved = resolve_mods(ModsConfig(**{field: value}), published=PUBLISHED, loka_mods=loka_mods)
    assert getattr(resolved, field) == value
    fallback = LOKA_MODS if loka_mods else PUBLISHED
    for other in {"bias", "norm", "activation"} - {field}:
        assert getattr(resolved, other) == getattr(fallback, other)


@pytest.mark.parametrize(
    "cfg,match",
    [(ModsConfig(norm="batchnorm"), "model.mods.norm"), (ModsConfig(activation="gelu"), "model.mods.activation"),
     (ModsConfig(block_size=0), "model.mods.block_size")],
)
def test_invalid_values_raise_naming_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        resolve_mods(cfg, published=PUBLISHED, loka_mods=False)


def test_keep_bias_gives_matching_biasless_linears_a_zero_bias_only():
    from torch import nn

    from loka_trainer.models.mods import keep_biases

    model = nn.Sequential()
    model.add_module("gate", nn.Linear(4, 4, bias=False))
    model.add_module("mlp", nn.Linear(4, 4, bias=False))
    model.add_module("head", nn.Linear(4, 1))
    x = torch.randn(3, 4)
    before = model(x)
    assert keep_biases(model, ["*gate"]) == ["gate"]
    assert model.gate.bias is not None and torch.count_nonzero(model.gate.bias) == 0
    assert model.mlp.bias is None
    torch.testing.assert_close(model(x), before)
    assert keep_biases(model, ["head"]) == []  # already has one


def test_keep_bias_linear_init_draws_like_nn_linear_and_changes_the_function():
    from torch import nn

    from loka_trainer.models.mods import keep_biases

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 64, bias=False))
    x = torch.randn(3, 9)
    before = model(x)
    assert keep_biases(model, ["0"], init="linear") == ["0"]
    bias = model[0].bias
    assert bias.abs().max() <= 9**-0.5 and bias.abs().min() > 0 and bias.std() > 0.1 * 9**-0.5
    assert not torch.allclose(model(x), before)


def test_keep_bias_unknown_init_raises_naming_the_field():
    from torch import nn

    from loka_trainer.models.mods import keep_biases

    with pytest.raises(ValueError, match="model.mods.keep_bias_init"):
        keep_biases(nn.Sequential(nn.Linear(2, 2, bias=False)), ["*"], init="normal")


@pytest.mark.parametrize("init,nonzero", [("zero", False), ("linear", True)])
def test_build_model_passes_keep_bias_init(init, nonzero, small_config, schema):
    from loka_trainer.models.zoo import build_model

    mods = ModsConfig(keep_bias=["head_arch.over_arch.mlp.0"], keep_bias_init=init)
    model = build_model(small_config("interformer", mods=mods), schema=schema, loka_mods=True)
    assert bool(torch.count_nonzero(model.head_arch.over_arch.mlp[0].bias)) == nonzero
