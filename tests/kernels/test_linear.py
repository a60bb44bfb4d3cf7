from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.kernels.backends import available_backends
from loka_trainer.kernels.linear import LoKALinear, register_weight_cache_hook

CPU_FP8 = [n for n in available_backends("cpu") if n != "bf16"]
GEMMS = ("forward", "input_grad", "weight_grad")


def _rel(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _run(layer, x):
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()  # non-uniform dy
    return y, x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("name", ["bf16"] + CPU_FP8)
def test_outputs_and_grads_match_linear(name):
    torch.manual_seed(0)
    ref = nn.Linear(128, 64)
    x = torch.randn(2, 48, 128)
    y0, dx0, dw0, db0 = _run(ref, x)
    ref.zero_grad()
    layer = LoKALinear.from_linear(ref, {g: name for g in GEMMS})
    y, dx, dw, db = _run(layer, x)
    tol = 0.02 if name == "bf16" else 0.12  # stated FP8 tolerance (e5m2 dy for tensorwise backward)
    assert y.shape == y0.shape and y.dtype == y0.dtype
    for a, b in [(y, y0), (dx, dx0), (dw, dw0), (db, db0)]:
        assert _rel(a, b) < tol


def test_mixed_routing_and_bf16_fallback_for_ragged_batch():
    torch.manual_seed(1)
    ref = nn.Linear(64, 32, bias=False)
    layer = LoKALinear.from_linear(ref, {"forward": "scaled_mm_rowwise", "weight_grad": "scaled_mm_tensorwise"})
    assert layer.backends["input_grad"] == "bf16"
    x = torch.randn(37, 64, requires_grad=True)  # 37 rows: FP8 backends cannot run it -> bf16 for this call
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all() and _rel(layer(x), ref(x)) < 0.01


def test_state_dict_compatible_both_ways():
    lin = nn.Linear(32, 16)
    lk = LoKALinear(32, 16, backends={"forward": "scaled_mm_rowwise"})
    assert set(lk.state_dict()) == set(lin.state_dict())
    lk.load_state_dict(lin.state_dict())
    assert torch.equal(lk.weight, lin.weight)
    lin2 = nn.Linear(32, 16)
    lin2.load_state_dict(lk.state_dict())
    assert torch.equal(lin2.bias, lin.bias)


def test_weight_cast_once_per_optimizer_step():
    torch.manual_seed(2)
    layer = LoKALinear(64, 32, backends={g: "scaled_mm_rowwise" for g in GEMMS})
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    register_weight_cache_hook(layer, opt)
    for step in range(3):
        for _ in range(2):  # two micro-batches reuse the same FP8 weight operands
            layer(torch.randn(16, 64, requires_grad=True)).sum().backward()
        assert layer._weight_cache.num_casts == 2 * (step + 1)  # forward + input-grad operand, once per step
        opt.step()
        opt.zero_grad()


def test_bad_routing_rejected():
    with pytest.raises(ValueError, match="unknown GEMM"):
        LoKALinear(16, 16, backends={"fwd": "bf16"})
    with pytest.raises(ValueError, match="backend: unknown"):
        LoKALinear(16, 16, backends={"forward": "nope"})


@pytest.mark.slow
def test_autocast_output_dtype_and_compile():
    torch.manual_seed(3)
    layer = LoKALinear(64, 32, backends={"forward": "scaled_mm_rowwise", "input_grad": "scaled_mm_tensorwise"})
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    compiled = torch.compile(layer)
    xc = x.clone().requires_grad_()
    y = compiled(xc)
    y.sum().backward()
    # 4e-3: bf16 resolution (compiled, the CPU GEMM's scales and bias fuse without the eager bf16 rounding)
    assert _rel(y, layer(x)) < 4e-3 and xc.grad.shape == x.shape


@pytest.mark.parametrize("hooked", [True, False])
def test_weight_rewritten_without_version_bump_is_recast_after_a_hooked_optimizer_step(hooked):
    """What FSDP2 does: the all-gather rewrites the unsharded weight in place without bumping its version
    counter (here: through ``.data``), possibly at the same address; the optimizer steps the shards. With
    ``register_weight_cache_hook`` the step clears the cache; without it nothing is reused across calls."""
    torch.manual_seed(3)
    layer = LoKALinear(64, 32, bias=False, backends={"forward": "scaled_mm_rowwise"})
    shard = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([shard], lr=0.1)
    if hooked:
        handle = register_weight_cache_hook(layer, opt)
    x = torch.randn(16, 64)
    before = layer(x)
    new_weight = torch.randn(32, 64) / 8
    version, ptr = layer.weight._version, layer.weight.data_ptr()
    layer.weight.data.copy_(new_weight)
    assert (layer.weight._version, layer.weight.data_ptr()) == (version, ptr)  # the old key still matches
    shard.grad = torch.ones(1)
    opt.step()
    fresh = LoKALinear(64, 32, bias=False, backends={"forward": "scaled_mm_rowwise"})
    fresh.weight.data.copy_(new_weight)
    torch.testing.assert_close(layer(x), fresh(x), rtol=0, atol=0)
    assert not torch.equal(layer(x), before)
    if hooked:  # removed: no step clears the cache any more, so every call quantizes afresh again
        handle.remove()
        newer = torch.randn(32, 64) / 8
        layer.weight.data.copy_(newer)
        fresh.weight.data.copy_(newer)
        torch.testing.assert_close(layer(x), fresh(x), rtol=0, atol=0)


def test_weight_cache_hook_reaches_fused_mods_layers():
    from loka_trainer.kernels.linear import weight_caches
    from loka_trainer.mods.module import FusedLinearMods
    model = nn.Sequential(LoKALinear(64, 32), nn.ReLU(), FusedLinearMods(32, 256))
    assert weight_caches(model) == [model[0]._weight_cache, model[2]._weight_cache]


def test_loading_a_state_dict_clears_the_cached_weight():
    layer = LoKALinear(64, 32, backends={"forward": "scaled_mm_rowwise"})
    x = torch.randn(16, 64)
    layer(x)
    other = nn.Linear(64, 32)
    layer.load_state_dict(other.state_dict())
    fresh = LoKALinear(64, 32, backends={"forward": "scaled_mm_rowwise"})
    fresh.load_state_dict(other.state_dict())
    torch.testing.assert_close(layer(x), fresh(x), rtol=0, atol=0)
