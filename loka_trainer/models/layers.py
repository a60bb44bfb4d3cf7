"""Building blocks shared by every model (the LoKA Mods layers themselves live in ``loka_trainer.mods.layers``).

Notation: B batch (any leading dims), N features of the last dim, b block size.

The registries ``NORMS`` and ``ACTIVATIONS`` are the Mods switches: a model never names a layer
class, it asks ``make_norm(name, ...)`` / ``make_activation(name)`` so that ``model.mods.*`` decides.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from loka_trainer.mods.layers import BlockNorm, EPS, HardSwish


def _layernorm(num_features: int, *, bias: bool, block_size: int) -> nn.Module:
    return nn.LayerNorm(num_features, bias=bias)  # NOTE: the no-bias Mod also drops LayerNorm's shift


def _rmsnorm(num_features: int, *, bias: bool, block_size: int) -> nn.Module:
    return nn.RMSNorm(num_features, eps=EPS)


def _blocknorm(num_features: int, *, bias: bool, block_size: int) -> nn.Module:
    return BlockNorm(num_features, block_size=block_size)


def _no_norm(num_features: int, *, bias: bool, block_size: int) -> nn.Module:
    return nn.Identity()


NORMS: dict[str, Callable[..., nn.Module]] = {
    "none": _no_norm,
    "layernorm": _layernorm,
    "rmsnorm": _rmsnorm,
    "blocknorm": _blocknorm,
}

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "hardswish": HardSwish,
}


def make_norm(name: str, num_features: int, *, bias: bool, block_size: int) -> nn.Module:
    """Norm layer ``name`` from ``NORMS`` over the last dim of width ``num_features``."""
    if name not in NORMS:
        raise ValueError(f"model.mods.norm={name!r} is not one of {sorted(NORMS)}")
    return NORMS[name](num_features, bias=bias, block_size=block_size)


def make_activation(name: str) -> nn.Module:
    """Activation layer ``name`` from ``ACTIVATIONS``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"model.mods.activation={name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


def mlp(
    in_features: int,
    widths: Sequence[int],
    *,
    bias: bool,
    norm: str,
    activation: str,
    block_size: int,
) -> nn.Sequential:
    """``[Linear -> norm -> activation] * len(widths)``; every layer gets norm and activation.

    Linear ``i`` is child ``3 * i`` for every switch setting.

    (..., in_features) -> (..., widths[-1]), or the identity when ``widths`` is empty.
    Prediction heads add their own biased ``nn.Linear`` after this (the final layer keeps its bias).
    """
    layers: list[nn.Module] = []
    for width in widths:
        layers += [
            nn.Linear(in_features, width, bias=bias),
            make_norm(norm, width, bias=bias, block_size=block_size),
            make_activation(activation),
        ]
        in_features = width
    # NOTE: ``norm="none"`` keeps an ``nn.Identity`` slot so Linear FQNs (``mlp.0``, ``mlp.3``, ...) are
    # the same for every norm choice: Dispatch plans and Probe statistics are keyed by FQN.
    return nn.Sequential(*layers)


class OverArch(nn.Module):
    """Prediction head: ``mlp(widths)`` then the final prediction ``nn.Linear(., 1)``, which always
    keeps its bias (LoKA keeps biases on prediction layers, paper III-B1).

    (B, in_features) -> logits (B,)
    """

    def __init__(
        self, in_features: int, widths: Sequence[int], *, bias: bool, norm: str, activation: str, block_size: int
    ) -> None:
        super().__init__()
        self.mlp = mlp(in_features, widths, bias=bias, norm=norm, activation=activation, block_size=block_size)
        self.prediction = nn.Linear(widths[-1] if widths else in_features, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.prediction(self.mlp(features)).squeeze(-1)


def token_linear(tokens: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """out[b] = weight · tokens[b] (+ bias per output token): tokens (B, n_in, D), weight (n_out, n_in),
    bias (n_out,) or None -> (B, n_out, D). One batched GEMM that reads the tokens where they lie (no transposed
    copy) and shares the weight across the batch (stride-0 expand, cast before expanding so autocast does not
    materialise B copies)."""
    dev = tokens.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else tokens.dtype
    out = torch.bmm(weight.to(dtype).expand(tokens.shape[0], -1, -1), tokens.to(dtype))
    return out if bias is None else out + bias.to(dtype)[:, None]


class TokenMix(nn.Module):
    """A Linear along the token axis: recombines n_in embeddings into n_out (Wukong LCB style).

    (B, n_in, D) -> (B, n_out, D). The weight lives in an ``nn.Linear`` child (state_dict ``linear.weight``) so
    Probe, Dispatch and torchao see the GEMM. While that child is a plain ``nn.Linear`` without forward
    hooks other than plain forward pre-hooks, the mix runs as ``token_linear`` (no transposed copies of the tokens:
    on an H200 the transposing copy of the Linear route took 3-5 ms per Wukong layer at batch 8192, CHANGELOG.md
    2026-11-30). Its forward pre-hooks (the Probe's, Dispatch calibration's) are called first with the child's
    (B, D, n_in) input as a view, so observers see what the Linear would; a pre-hook that returns a new input makes
    the child run on it. When a precision transform replaced the child (an FP8 Linear) or other hooks are on it,
    the child runs on the transposed tokens. Same math either way.
    """

    def __init__(self, num_in: int, num_out: int, *, bias: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(num_in, num_out, bias=bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        if type(lin) is not nn.Linear or not _only_plain_pre_hooks(lin):
            return _transposed(lin, tokens.transpose(1, 2))
        args, replaced = (tokens.transpose(1, 2),), False  # the child's (B, D, n_in) input, as a view
        for hook in lin._forward_pre_hooks.values():  # nn.Module's pre-hook rules: a returned value replaces args
            result = hook(lin, args)
            if result is not None:
                args, replaced = (result if isinstance(result, tuple) else (result,)), True
        if replaced:
            return _transposed(lin.forward, args[0])
        return token_linear(tokens, lin.weight, lin.bias)


def _only_plain_pre_hooks(lin: nn.Linear) -> bool:
    """No forward, backward or keyword pre-hooks on ``lin``: its plain pre-hooks can be called by hand."""
    return not (lin._forward_hooks or lin._forward_pre_hooks_with_kwargs or lin._backward_hooks
                or lin._backward_pre_hooks)


def _transposed(linear, x: torch.Tensor) -> torch.Tensor:
    """``linear`` on x (B, D, n_in) -> (B, n_out, D)."""
    # NOTE: contiguous on both sides: FP8 Linears (torchao rowwise) reject non-contiguous inputs with axiswise
    # scales, and the next Linear (e.g. InterFormer's gate) gets this output as its input.
    return linear(x.contiguous()).transpose(1, 2).contiguous()


class DenseEmbeddingArch(nn.Module):
    """Dense features to ``num_tokens`` embeddings: (B, F_d) -> (B, num_tokens, D)."""

    def __init__(
        self,
        num_dense: int,
        widths: Sequence[int],
        num_tokens: int,
        dim: int,
        *,
        bias: bool,
        norm: str,
        activation: str,
        block_size: int,
    ) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.mlp = mlp(
            num_dense, [*widths, num_tokens * dim], bias=bias, norm=norm, activation=activation, block_size=block_size
        )

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(dense).unflatten(1, (self.num_tokens, -1))
