"""Feature-interaction modules shared by DLRM and InterFormer.

Notation: B batch, m tokens (embeddings) that interact, D embedding dim, p = m * D flattened width,
r low rank of the cross net.

Every interaction maps tokens (B, m, D) to a flat feature vector (B, output_dim); ``INTERACTIONS``
is the registry InterFormer's ``interaction`` field selects from.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from loka_trainer.models.mods import ResolvedMods


def pairwise_dots(tokens: torch.Tensor) -> torch.Tensor:
    """All distinct inner products ``<z_i, z_j>``, i < j.

    tokens: (B, m, D) -> (B, m * (m - 1) / 2), in row-major upper-triangle order.
    """
    num_tokens = tokens.shape[1]
    gram = torch.bmm(tokens, tokens.transpose(1, 2))  # (B, m, m)
    rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1, device=tokens.device)
    return gram[:, rows, cols]


class DotInteraction(nn.Module):
    """DLRM's pairwise dot interaction; no parameters.

    tokens (B, m, D) -> cat(first ``num_passthrough`` tokens flattened, pairwise dots):
    (B, num_passthrough * D + m (m - 1) / 2). DLRM passes the dense token through (1);
    InterFormer passes every token through (m) so the MLP also sees first-order terms.
    """

    def __init__(self, num_tokens: int, dim: int, *, num_passthrough: int) -> None:
        super().__init__()
        self.num_passthrough = num_passthrough
        self.output_dim = num_passthrough * dim + num_tokens * (num_tokens - 1) // 2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        passthrough = tokens[:, : self.num_passthrough].flatten(1)  # (B, num_passthrough * D)
        return torch.cat([passthrough, pairwise_dots(tokens)], dim=1)


class LowRankCrossNet(nn.Module):
    """DCNv2 low-rank cross network: ``x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l``.

    (B, p) -> (B, p). ``b_l`` is ``U_l``'s bias, so the no-bias Mod removes it. The layers are plain
    ``nn.Linear`` so LoKA Probe / Dispatch see them like any MLP layer.
    """

    def __init__(self, in_features: int, *, num_layers: int, rank: int, bias: bool) -> None:
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(in_features, rank, bias=False) for _ in range(num_layers))
        self.up = nn.ModuleList(nn.Linear(rank, in_features, bias=bias) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return x


class CrossInteraction(nn.Module):
    """DCNv2 as a token interaction: flatten then cross. (B, m, D) -> (B, m * D)."""

    def __init__(self, num_tokens: int, dim: int, *, num_layers: int, rank: int, bias: bool) -> None:
        super().__init__()
        self.output_dim = num_tokens * dim
        self.cross = LowRankCrossNet(self.output_dim, num_layers=num_layers, rank=rank, bias=bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.cross(tokens.flatten(1))


def _inner_product(num_tokens: int, dim: int, *, cross_layers: int, cross_rank: int, mods: ResolvedMods) -> nn.Module:
    return DotInteraction(num_tokens, dim, num_passthrough=num_tokens)


def _dcnv2(num_tokens: int, dim: int, *, cross_layers: int, cross_rank: int, mods: ResolvedMods) -> nn.Module:
    return CrossInteraction(num_tokens, dim, num_layers=cross_layers, rank=cross_rank, bias=mods.bias)


INTERACTIONS: dict[str, Callable[..., nn.Module]] = {
    "inner_product": _inner_product,
    "dcnv2": _dcnv2,
}


def build_interaction(
    name: str, num_tokens: int, dim: int, *, cross_layers: int, cross_rank: int, mods: ResolvedMods
) -> nn.Module:
    """Interaction ``name`` from ``INTERACTIONS``: a module (B, m, D) -> (B, .output_dim)."""
    if name not in INTERACTIONS:
        raise ValueError(f"model.interaction={name!r} is not one of {sorted(INTERACTIONS)}")
    return INTERACTIONS[name](num_tokens, dim, cross_layers=cross_layers, cross_rank=cross_rank, mods=mods)
