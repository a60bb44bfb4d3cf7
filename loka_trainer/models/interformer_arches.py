"""InterFormer's per-layer arches (arXiv 2411.09852): Interaction, Sequence and Cross Arch.

Notation: B batch, n non-sequence tokens, D embedding dim, S = n_cls + T sequence tokens
(CLS tokens first, then the behaviour sequence with the newest item last), mask (B, S) bool,
n_xs = compressed non-sequence tokens (X_sum), n_ss = n_cls + n_pma + n_recent (S_sum).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from loka_trainer.models.attention import MultiHeadAttention, PoolingByMultiheadAttention
from loka_trainer.models.interactions import build_interaction
from loka_trainer.models.layers import TokenMix, make_norm, mlp
from loka_trainer.models.mods import ResolvedMods


class InteractionArch(nn.Module):
    """X' = norm(X + reshape(Linear(MLP(interaction([X || S_sum]))))).

    x (B, n, D), s_sum (B, n_ss, D) -> (B, n, D). ``interaction`` comes from ``INTERACTIONS``.
    """

    def __init__(
        self, interaction: nn.Module, num_tokens: int, dim: int, widths: Sequence[int], mods: ResolvedMods
    ) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.interaction = interaction
        self.mlp = mlp(interaction.output_dim, widths, **mods.layer_kwargs())
        self.out = nn.Linear(widths[-1] if widths else interaction.output_dim, num_tokens * dim, bias=mods.bias)
        self.norm = make_norm(mods.norm, dim, bias=mods.bias, block_size=mods.block_size)

    def forward(self, x: torch.Tensor, s_sum: torch.Tensor) -> torch.Tensor:
        features = self.interaction(torch.cat([x, s_sum], dim=1))  # (B, interaction.output_dim)
        update = self.out(self.mlp(features)).unflatten(1, (self.num_tokens, -1))  # (B, n, D)
        return self.norm(x + update)


class SequenceArch(nn.Module):
    """Personalized FFN driven by X_sum, then masked self-attention; residual + norm after each.

    PFFN(X_sum, S) = S @ P(X_sum) / sqrt(D), P = reshape(Linear(MLP(flatten(X_sum)))) in (B, D, D).
    s (B, S, D), mask (B, S), x_sum (B, n_xs, D) -> (B, S, D), zero at padded positions.

    LoKA Dispatch keeps the weight generator ``personal_weight`` BF16 (``loka_keep_bf16``): its output is the
    per-sample FFN's weights, applied to every sequence item, and its FP8 forward cost 0.21% eval log loss at GPU
    scale in both seeds while its MERE looked like every other layer's
    (docs/results/quality_interformer_h200_keep_generators_bf16).
    """

    loka_keep_bf16 = ("personal_weight",)

    def __init__(
        self, num_summary: int, dim: int, num_heads: int, widths: Sequence[int], mods: ResolvedMods
    ) -> None:
        super().__init__()
        self.dim = dim
        self.personalize = mlp(num_summary * dim, widths, **mods.layer_kwargs())
        self.personal_weight = nn.Linear(widths[-1] if widths else num_summary * dim, dim * dim, bias=mods.bias)
        self.pffn_norm = make_norm(mods.norm, dim, bias=mods.bias, block_size=mods.block_size)
        self.attention = MultiHeadAttention(dim, num_heads, bias=mods.bias)
        self.attention_norm = make_norm(mods.norm, dim, bias=mods.bias, block_size=mods.block_size)

    def forward(self, s: torch.Tensor, mask: torch.Tensor, x_sum: torch.Tensor) -> torch.Tensor:
        weight = self.personal_weight(self.personalize(x_sum.flatten(1))).unflatten(1, (self.dim, self.dim))
        s = self.pffn_norm(s + torch.bmm(s, weight) * self.dim**-0.5)  # (B, S, D)
        s = self.attention_norm(s + self.attention(s, s, mask))
        return s * mask.unsqueeze(-1).to(s.dtype)  # padded positions stay zero for the next layer


class CrossArch(nn.Module):
    """Summaries exchanged between the two branches, each with a sigmoid self-gate.

    X_sum = gate(TokenMix(X)) (B, n_xs, D); S_sum = gate([CLS tokens || PMA(S) || newest tokens])
    (B, n_ss, D). x (B, n, D), s (B, S, D), mask (B, S) -> (X_sum, S_sum).
    """

    def __init__(
        self,
        num_tokens: int,
        dim: int,
        *,
        num_summary: int,
        num_cls: int,
        num_pma: int,
        num_recent: int,
        num_heads: int,
        mods: ResolvedMods,
    ) -> None:
        super().__init__()
        self.num_cls, self.num_recent = num_cls, num_recent
        self.compress = TokenMix(num_tokens, num_summary, bias=mods.bias)
        self.x_gate = nn.Linear(dim, dim, bias=mods.bias)
        self.pma = PoolingByMultiheadAttention(dim, num_pma, num_heads, bias=mods.bias)
        self.s_gate = nn.Linear(dim, dim, bias=mods.bias)
        self.num_s_summary = num_cls + num_pma + num_recent

    def forward(self, x: torch.Tensor, s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_sum = self.compress(x)  # (B, n_xs, D)
        recent = s[:, s.shape[1] - self.num_recent :]  # (B, n_recent, D); newest last, zero if padded
        s_sum = torch.cat([s[:, : self.num_cls], self.pma(s, mask), recent], dim=1)  # (B, n_ss, D)
        return x_sum * torch.sigmoid(self.x_gate(x_sum)), s_sum * torch.sigmoid(self.s_gate(s_sum))


def build_interaction_arch(
    name: str,
    num_tokens: int,
    num_s_summary: int,
    dim: int,
    *,
    widths: Sequence[int],
    cross_layers: int,
    cross_rank: int,
    mods: ResolvedMods,
) -> InteractionArch:
    """InteractionArch around ``INTERACTIONS[name]`` over n + n_ss tokens."""
    interaction = build_interaction(
        name, num_tokens + num_s_summary, dim, cross_layers=cross_layers, cross_rank=cross_rank, mods=mods
    )
    return InteractionArch(interaction, num_tokens, dim, widths, mods)
