"""Each Mods switch changes exactly the modules it should, in every registered model."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from torch import nn

from loka_trainer.models.layers import ACTIVATIONS, NORMS
from loka_trainer.models.mods import ModsConfig
from loka_trainer.models.zoo import MODELS, build_model
from loka_trainer.mods.layers import BlockNorm

NAMES = sorted(MODELS)
NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, BlockNorm)
ACTIVATION_TYPES = (nn.ReLU, nn.SiLU, nn.Hardswish)


@dataclasses.dataclass
class Census:
    biased_linears: set
    all_linears: dict  # fqn -> weight shape
    norms: Counter
    activations: Counter
    layernorm_biases: int


def _census(model: nn.Module) -> Census:
    modules = list(model.named_modules())
    linears = {n: tuple(m.weight.shape) for n, m in modules if isinstance(m, nn.Linear)}
    return Census(
        biased_linears={n for n, m in modules if isinstance(m, nn.Linear) and m.bias is not None},
        all_linears=linears,
        norms=Counter(type(m).__name__ for _, m in modules if isinstance(m, NORM_TYPES)),
        activations=Counter(type(m).__name__ for _, m in modules if isinstance(m, ACTIVATION_TYPES)),
        layernorm_biases=sum(1 for _, m in modules if isinstance(m, nn.LayerNorm) and m.bias is not None),
    )


def _always_bias_free(census: Census) -> set:
    """DCNv2's low-rank down projections V_l: the published cross net has its bias in U_l only."""
    return {n for n in census.all_linears if ".down." in n}


def _build(name, small_config, schema, *, loka_mods=False, **mods):
    return _census(build_model(small_config(name, mods=ModsConfig(**mods)), schema=schema, loka_mods=loka_mods))


@pytest.mark.parametrize("name", NAMES)
def test_bias_switch_keeps_only_the_prediction_bias(name, small_config, schema):
    with_bias = _build(name, small_config, schema, bias=True, norm="layernorm")
    without = _build(name, small_config, schema, bias=False, norm="layernorm")
    assert with_bias.biased_linears == set(with_bias.all_linears) - _always_bias_free(with_bias)
    assert len(without.biased_linears) == 1 and next(iter(without.biased_linears)).endswith("prediction")
    assert with_bias.layernorm_biases == sum(with_bias.norms.values()) and without.layernorm_biases == 0
    assert without.all_linears == with_bias.all_linears
    assert (without.norms, without.activations) == (with_bias.norms, with_bias.activations)


@pytest.mark.parametrize("name", NAMES)
def test_norm_switch_replaces_every_norm_and_nothing_else(name, small_config, schema):
    reference = _build(name, small_config, schema, norm="layernorm")
    num_slots = reference.norms["LayerNorm"]
    assert num_slots > 0
    expected_type = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "blocknorm": "BlockNorm"}
    for norm in NORMS:
        census = _build(name, small_config, schema, norm=norm)
        assert census.norms == (Counter() if norm == "none" else Counter({expected_type[norm]: num_slots}))
        assert census.biased_linears == reference.biased_linears  # also: Linear FQNs do not move
        assert census.activations == reference.activations


@pytest.mark.parametrize("name", NAMES)
def test_activation_switch_replaces_every_activation_and_nothing_else(name, small_config, schema):
    reference = _build(name, small_config, schema, activation="relu")
    num_slots = reference.activations["ReLU"]
    assert num_slots > 0
    expected_type = {"relu": "ReLU", "silu": "SiLU", "hardswish": "HardSwish"}
    for activation in ACTIVATIONS:
        census = _build(name, small_config, schema, activation=activation)
        assert census.activations == Counter({expected_type[activation]: num_slots})
        assert (census.norms, census.biased_linears) == (reference.norms, reference.biased_linears)


@pytest.mark.parametrize("name", NAMES)
def test_loka_mods_defaults_and_explicit_override(name, small_config, schema):
    loka = _build(name, small_config, schema, loka_mods=True)
    assert set(loka.norms) == {"BlockNorm"} and set(loka.activations) == {"HardSwish"}
    assert len(loka.biased_linears) == 1
    override = _build(name, small_config, schema, loka_mods=True, norm="rmsnorm", bias=True)
    assert set(override.norms) == {"RMSNorm"} and set(override.activations) == {"HardSwish"}
    assert override.biased_linears == set(override.all_linears) - _always_bias_free(override)


def test_published_defaults(small_config, schema):
    dlrm = _build("dlrm", small_config, schema)
    assert not dlrm.norms and set(dlrm.activations) == {"ReLU"}
    assert dlrm.biased_linears == set(dlrm.all_linears)
    for name in ("wukong", "interformer"):
        census = _build(name, small_config, schema)
        assert set(census.norms) == {"LayerNorm"} and set(census.activations) == {"SiLU"}
