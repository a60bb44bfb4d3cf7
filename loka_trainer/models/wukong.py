"""Wukong (arXiv 2403.02545): stacked Factorization Machine Blocks + Linear Compress Blocks.

Notation: B batch, F_d dense features, F_s sparse features, D embedding dim (paper d),
n_i embeddings entering layer i (n_0 = num_dense_embeddings + F_s), n_F FMB outputs,
n_L LCB outputs, k FM projection rank.

    X_0 = [dense MLP(F_d) as num_dense_embeddings tokens || sparse embeddings]     (B, n_0, D)
    X_{i+1} = norm(concat(FMB(X_i), LCB(X_i)) + residual(X_i))                     (B, n_F + n_L, D)
    FMB(X) = Linear(MLP(norm(flatten(X (X^T Y)))))  -> (B, n_F, D),  Y: (n_i, k) learnable
    LCB(X) = W X  -> (B, n_L, D),  W: (n_L, n_i)
    logits = OverArch(flatten(X_L))

Published defaults (``PUBLISHED_MODS``): biases on, LayerNorm, SiLU (the Swish that the LoKA paper
replaces in its production Wukong; the Wukong paper itself does not pin the activation).
Mods touch: bias of every Linear (dense MLP, FM projection Y, FMB MLP and output, LCB, residual
projection, over arch; not the prediction layer); norm = FMB's norm over the flattened FM output,
each MLP layer's norm and the inter-layer norm over D; activation = every MLP activation.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from loka_trainer.data.batch import Batch, DataSchema
from loka_trainer.models.layers import DenseEmbeddingArch, OverArch, TokenMix, make_norm, mlp
from loka_trainer.models.configs import WukongConfig  # noqa: F401 - re-exported
from loka_trainer.models.mods import ResolvedMods, resolve_mods
from loka_trainer.models.sparse import SparseArch, build_ebc

PUBLISHED_MODS = ResolvedMods(bias=True, norm="layernorm", activation="silu")


class FactorizationMachineBlock(nn.Module):
    """Optimized FM: ``X (X^T Y)`` with a learnable rank-k ``Y``, then norm + MLP to n_F embeddings.

    (B, n_in, D) -> (B, n_F, D)
    """

    def __init__(
        self, num_in: int, dim: int, *, rank: int, num_out: int, widths: List[int], mods: ResolvedMods
    ) -> None:
        super().__init__()
        self.num_out = num_out
        self.projection = TokenMix(num_in, rank, bias=mods.bias)  # X^T Y, as (B, k, D)
        self.norm = make_norm(mods.norm, num_in * rank, bias=mods.bias, block_size=mods.block_size)
        self.mlp = mlp(num_in * rank, widths, **mods.layer_kwargs())
        self.out = nn.Linear(widths[-1] if widths else num_in * rank, num_out * dim, bias=mods.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        projected = self.projection(tokens)  # (B, k, D)
        fm = torch.bmm(tokens, projected.transpose(1, 2))  # (B, n_in, k)
        hidden = self.mlp(self.norm(fm.flatten(1)))  # (B, widths[-1])
        return self.out(hidden).unflatten(1, (self.num_out, -1))  # (B, n_F, D)


class WukongLayer(nn.Module):
    """One interaction layer: norm(concat(FMB(X), LCB(X)) + residual(X)). (B, n_in, D) -> (B, n_F + n_L, D)"""

    def __init__(self, num_in: int, cfg: WukongConfig, mods: ResolvedMods) -> None:
        super().__init__()
        d, num_out = cfg.embedding_dim, cfg.num_fm_embeddings + cfg.num_lc_embeddings
        self.fmb = FactorizationMachineBlock(
            num_in, d, rank=cfg.fm_rank, num_out=cfg.num_fm_embeddings, widths=cfg.fmb_widths, mods=mods
        )
        self.lcb = TokenMix(num_in, cfg.num_lc_embeddings, bias=mods.bias)
        # The residual needs a projection only when the number of embeddings changes.
        self.residual = nn.Identity() if num_in == num_out else TokenMix(num_in, num_out, bias=mods.bias)
        self.norm = make_norm(mods.norm, d, bias=mods.bias, block_size=mods.block_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mixed = torch.cat([self.fmb(tokens), self.lcb(tokens)], dim=1)  # (B, n_F + n_L, D)
        return self.norm(mixed + self.residual(tokens))


class Wukong(nn.Module):
    """sparse_arch + dense_arch -> X_0 -> layers -> over_arch -> logits (B,)."""

    def __init__(
        self, *, sparse_arch: SparseArch, dense_arch: DenseEmbeddingArch, layers: nn.ModuleList, over_arch: OverArch
    ) -> None:
        super().__init__()
        self.sparse_arch = sparse_arch
        self.dense_arch = dense_arch
        self.layers = layers
        self.over_arch = over_arch

    def forward(self, batch: Batch) -> torch.Tensor:
        tokens = torch.cat([self.dense_arch(batch.dense), self.sparse_arch(batch.sparse)], dim=1)  # (B, n_0, D)
        for layer in self.layers:
            tokens = layer(tokens)  # (B, n_F + n_L, D)
        return self.over_arch(tokens.flatten(1))

    def dense_units(self) -> list[nn.Module]:
        return [self.dense_arch, *self.layers, self.over_arch]


def build_wukong(cfg: WukongConfig, *, schema: DataSchema, loka_mods: bool) -> Wukong:
    """Wukong sized by ``cfg`` over the features of ``schema``."""
    if cfg.num_layers < 1:
        raise ValueError(f"model.num_layers must be >= 1, got {cfg.num_layers}")
    mods = resolve_mods(cfg.mods, published=PUBLISHED_MODS, loka_mods=loka_mods)
    num_in = cfg.num_dense_embeddings + len(schema.sparse_features)
    layers = []
    for _ in range(cfg.num_layers):
        layers.append(WukongLayer(num_in, cfg, mods))
        num_in = cfg.num_fm_embeddings + cfg.num_lc_embeddings
    return Wukong(
        sparse_arch=SparseArch(build_ebc(schema, cfg.embedding_dim)),
        dense_arch=DenseEmbeddingArch(
            schema.num_dense, cfg.dense_arch_widths, cfg.num_dense_embeddings, cfg.embedding_dim, **mods.layer_kwargs()
        ),
        layers=nn.ModuleList(layers),
        over_arch=OverArch(num_in * cfg.embedding_dim, cfg.over_arch_widths, **mods.layer_kwargs()),
    )
