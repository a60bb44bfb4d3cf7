from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.models.layers import (
    NORMS, OverArch, TokenMix, make_activation, make_norm, mlp, token_linear,
)
from loka_trainer.mods.layers import BlockNorm, HardSwish, block_rms_norm


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("width,block", [(64, 64), (48, 256), (1, 8)])
def test_blocknorm_with_one_block_equals_rmsnorm(width, block):
    x = torch.randn(5, 3, width, dtype=torch.float64) * 7 + 2
    expected = nn.RMSNorm(width, eps=1e-6, elementwise_affine=False).double()(x)
    torch.testing.assert_close(BlockNorm(width, block_size=block)(x), expected)


def test_blocknorm_normalizes_each_block_to_unit_rms():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 96, generator=gen) * torch.tensor([0.1] * 32 + [100.0] * 32 + [1.0] * 32)
    blocks = BlockNorm(96, block_size=32)(x).view(4, 3, 32)
    # NOTE: eps (1e-6) pulls the 0.1-scaled block's mean square below 1 by ~1e-6 / 0.01: tolerance 1e-3, not 1e-4
    torch.testing.assert_close(blocks.pow(2).mean(-1), torch.ones(4, 3), atol=1e-3, rtol=1e-3)


def test_blocknorm_statistics_are_per_block():
    norm = BlockNorm(96, block_size=32)
    x = torch.randn(6, 96)
    changed = x.clone()
    changed[:, 32:64] = changed[:, 32:64] * 50 + 3  # only the middle block
    y, y_changed = norm(x), norm(changed)
    torch.testing.assert_close(y_changed[:, :32], y[:, :32])
    torch.testing.assert_close(y_changed[:, 64:], y[:, 64:])
    assert not torch.allclose(y_changed[:, 32:64], y[:, 32:64])


def test_blocknorm_ragged_last_block_has_its_own_statistic():
    x = torch.randn(3, 70, dtype=torch.float64)
    y = BlockNorm(70, block_size=32)(x)
    expected = torch.cat([_rms(x[:, :32]), _rms(x[:, 32:64]), _rms(x[:, 64:])], dim=1)
    torch.testing.assert_close(y, expected)


def test_blocknorm_same_in_train_and_eval_and_parameter_free():
    norm = BlockNorm(512, block_size=256)
    x = torch.randn(8, 512)
    y_train = norm.train()(x)
    torch.testing.assert_close(norm.eval()(x), y_train)
    assert list(norm.parameters()) == []
    affine = BlockNorm(512, elementwise_affine=True)
    assert [p.shape for p in affine.parameters()] == [torch.Size([512])]


def test_block_rms_norm_ragged_gradients_pass_gradcheck():
    x = torch.randn(4, 40, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: block_rms_norm(t, 16), (x,))  # 40 = 2 full blocks + 8


def test_mlp_structure_follows_switches():
    net = mlp(10, [32, 16], bias=False, norm="blocknorm", activation="hardswish", block_size=16)
    kinds = [type(m) for m in net]
    assert kinds == [nn.Linear, BlockNorm, HardSwish, nn.Linear, BlockNorm, HardSwish]
    assert all(m.bias is None for m in net if isinstance(m, nn.Linear))
    assert net(torch.randn(3, 10)).shape == (3, 16)
    plain = mlp(10, [32], bias=True, norm="none", activation="relu", block_size=256)
    assert [type(m) for m in plain] == [nn.Linear, nn.Identity, nn.ReLU] and plain[0].bias is not None


def test_over_arch_prediction_keeps_bias():
    head = OverArch(12, [8], bias=False, norm="rmsnorm", activation="silu", block_size=256)
    assert head.prediction.bias is not None and head.mlp[0].bias is None
    assert head(torch.randn(5, 12)).shape == (5,)


@pytest.mark.parametrize("name", sorted(NORMS))
def test_norm_registry_builds_every_entry(name):
    layer = make_norm(name, 24, bias=True, block_size=8)
    y = layer(torch.randn(2, 24) * 5)
    assert y.shape == (2, 24)
    if name != "none":
        assert y.abs().max() < 10  # normalized


def test_unknown_registry_keys_list_valid_values():
    with pytest.raises(ValueError, match="blocknorm"):
        make_norm("batchnorm", 8, bias=True, block_size=8)
    with pytest.raises(ValueError, match="hardswish"):
        make_activation("gelu")


class _CountingLinear(nn.Linear):
    """Stands in for a precision transform's Linear subclass (torchao Float8Linear, LoKALinear)."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def test_token_mix_batched_gemm_equals_the_linear_route():
    torch.manual_seed(0)
    mix = TokenMix(12, 8, bias=True)
    tokens = torch.randn(5, 12, 32, requires_grad=True)
    fast = mix(tokens)  # plain nn.Linear child, no hooks: token_linear
    seen = []
    handle = mix.linear.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    slow = mix(tokens)  # a forward hook on the child: it runs on the transposed tokens
    handle.remove()
    assert seen == [(5, 32, 12)]
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(fast.square().sum(), [tokens, mix.linear.weight, mix.linear.bias])
    ref = torch.autograd.grad(slow.square().sum(), [tokens, mix.linear.weight, mix.linear.bias])
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _aten_ops(fn) -> list[str]:
    """The aten ops ``fn()`` runs (names like ``bmm``, ``clone``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        fn()
    return rec.ops


def test_token_mix_observed_by_a_pre_hook_keeps_the_batched_gemm():
    """The Probe's and calibration's pre-hooks see the child's (B, D, n_in) input without the mix paying the
    transposed copies of the Linear route (a persistent hook would otherwise slow every step)."""
    torch.manual_seed(0)
    mix = TokenMix(12, 8, bias=True)
    tokens = torch.randn(5, 12, 32)
    seen = []
    mix.linear.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    ops = _aten_ops(lambda: mix(tokens))
    assert "bmm" in ops and not {"clone", "addmm", "mm"} & set(ops)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], tokens.transpose(1, 2))
    torch.testing.assert_close(mix(tokens), mix.linear(tokens.transpose(1, 2)).transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_token_mix_pre_hook_that_replaces_the_input_is_honoured():
    torch.manual_seed(0)
    mix = TokenMix(12, 8, bias=True)
    tokens = torch.randn(5, 12, 32)
    mix.linear.register_forward_pre_hook(lambda mod, args: (2 * args[0],))
    seen = []
    mix.linear.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    out = mix(tokens)
    torch.testing.assert_close(seen[0], 2 * tokens.transpose(1, 2))  # later hooks see the replaced input
    torch.testing.assert_close(out, mix.linear.forward(2 * tokens.transpose(1, 2)).transpose(1, 2))


def test_token_mix_keeps_a_replaced_child_in_the_loop():
    mix = TokenMix(12, 8, bias=False)
    old = mix.linear
    mix.linear = _CountingLinear(12, 8, bias=False)
    mix.linear.weight = old.weight
    before = _CountingLinear.calls
    out = mix(torch.randn(3, 12, 16))
    assert _CountingLinear.calls == before + 1 and out.shape == (3, 8, 16)


def test_token_linear_under_autocast_runs_in_bf16():
    tokens, weight = torch.randn(4, 12, 16), torch.randn(8, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = token_linear(tokens, weight, None)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 8, 16)
    torch.testing.assert_close(out.float(), torch.einsum("ln,bnd->bld", weight, tokens), rtol=2e-2, atol=5e-2)
