"""LoKA Mods switches (paper III-B): no bias, BlockNorm, Hard Swish, as one per-model config.

Precedence, per field: an explicit ``ModsConfig`` value > the LoKA default (when ``loka_mods``,
i.e. ``precision=loka``) > the model's published default.

What each switch touches (every model; the model files list their own extra details):
- ``bias``: every ``nn.Linear`` of the dense part (MLPs, cross nets, Wukong LCB/FMB, attention
  projections, gates) and the shift of every ``LayerNorm``. The final prediction ``nn.Linear`` always
  keeps its bias; DCNv2's low-rank down projections ``V_l`` never have one (the cross net's bias is
  ``U_l``'s).
- ``norm``: every normalization layer of the dense part: after each MLP Linear, Wukong's
  inter-layer and FMB norms, InterFormer's residual norms. ``none`` removes them.
- ``activation``: every activation of every MLP. Softmax inside attention and sigmoid gates are
  not activations in this sense and keep their form.
- ``block_size``: BlockNorm's block (only used when ``norm == "blocknorm"``).
- ``keep_bias``: fnmatch patterns of Linear FQNs that keep (get back) a bias when ``bias`` is off, applied
  after the model is built (``keep_biases``): an escape hatch for the few layers a model needs a bias in.
- ``keep_bias_init``: how those biases start (``BIAS_INITS``): ``zero`` keeps the built model's function,
  ``linear`` draws them like ``nn.Linear`` does (uniform in +-1/sqrt(in_features)).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from loka_trainer.models.layers import ACTIVATIONS, NORMS


@dataclasses.dataclass
class ModsConfig:
    """Hydra schema ``model.mods``; ``None`` = published default, or LoKA's when ``precision=loka``."""

    bias: Optional[bool] = None
    norm: Optional[str] = None
    activation: Optional[str] = None
    block_size: int = 256
    keep_bias: List[str] = dataclasses.field(default_factory=list)
    keep_bias_init: str = "zero"


@dataclasses.dataclass(frozen=True)
class ResolvedMods:
    """The concrete switches a model is built with."""

    bias: bool
    norm: str
    activation: str
    block_size: int = 256

    def layer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``layers.mlp`` / ``layers.make_norm``-style builders."""
        return dataclasses.asdict(self)


LOKA_MODS = ResolvedMods(bias=False, norm="blocknorm", activation="hardswish")


def resolve_mods(cfg: ModsConfig, *, published: ResolvedMods, loka_mods: bool) -> ResolvedMods:
    """Pure: fill every ``None`` of ``cfg`` from LoKA's defaults (``loka_mods``) or ``published``."""
    fallback = LOKA_MODS if loka_mods else published
    resolved = ResolvedMods(
        bias=fallback.bias if cfg.bias is None else cfg.bias,
        norm=fallback.norm if cfg.norm is None else cfg.norm,
        activation=fallback.activation if cfg.activation is None else cfg.activation,
        block_size=cfg.block_size,
    )
    if resolved.norm not in NORMS:
        raise ValueError(f"model.mods.norm={resolved.norm!r} is not one of {sorted(NORMS)}")
    if resolved.activation not in ACTIVATIONS:
        raise ValueError(f"model.mods.activation={resolved.activation!r} is not one of {sorted(ACTIVATIONS)}")
    if resolved.block_size <= 0:
        raise ValueError(f"model.mods.block_size must be a positive int, got {resolved.block_size}")
    return resolved


@torch.no_grad()
def _zero_bias(linear: nn.Linear) -> torch.Tensor:
    """(out_features,) zeros: the model's function is unchanged."""
    return torch.zeros(linear.out_features, device=linear.weight.device, dtype=linear.weight.dtype)


@torch.no_grad()
def _linear_bias(linear: nn.Linear) -> torch.Tensor:
    """(out_features,) uniform in +-1/sqrt(in_features), as ``nn.Linear.reset_parameters`` draws it."""
    bound = 1.0 / math.sqrt(linear.in_features) if linear.in_features > 0 else 0.0
    return _zero_bias(linear).uniform_(-bound, bound)


BIAS_INITS: dict[str, Callable[[nn.Linear], torch.Tensor]] = {"zero": _zero_bias, "linear": _linear_bias}


def matching_linears(model: nn.Module, patterns: List[str]) -> list[str]:
    """FQNs of every ``nn.Linear`` of ``model`` (biased or not) that matches one of the fnmatch ``patterns``."""
    return [fqn for fqn, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(fnmatch.fnmatch(fqn, p) for p in patterns)]


def keep_biases(model: nn.Module, patterns: List[str], *, init: str = "zero") -> list[str]:
    """Give every bias-less ``nn.Linear`` whose FQN matches one of ``patterns`` a bias drawn by ``BIAS_INITS[init]``.

    Returns the FQNs changed. A zero bias leaves the model's initial function unchanged.
    """
    if init not in BIAS_INITS:
        raise ValueError(f"model.mods.keep_bias_init={init!r} is not one of {sorted(BIAS_INITS)}")
    changed = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.bias is None and any(fnmatch.fnmatch(fqn, p) for p in patterns):
            module.bias = nn.Parameter(BIAS_INITS[init](module))
            changed.append(fqn)
    return changed
