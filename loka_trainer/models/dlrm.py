"""DLRM (dot interaction) and DLRM-DCNv2, structured like ``torchrec/models/dlrm.py``.

Notation: B batch, F_d dense features, F_s sparse features, D embedding dim,
m = F_s + 1 interacting tokens (the dense arch output is one more token), p = m * D.

Published defaults (``PUBLISHED_MODS``): biases on, no norm, ReLU. Sizes default to the MLPerf
DLRM / DLRM-DCNv2 Criteo-Terabyte configuration; ``conf/model/dlrm*.yaml`` shrink them for CPU.
Mods touch: dense-arch and over-arch MLPs (bias, norm, activation) and, for DCNv2, the cross
net's ``U_l`` biases. The dot interaction has no parameters.
"""
from __future__ import annotations


import torch
from torch import nn

from loka_trainer.data.batch import Batch, DataSchema
from loka_trainer.models.interactions import CrossInteraction, DotInteraction
from loka_trainer.models.layers import OverArch, mlp
from loka_trainer.models.configs import DLRMConfig, DLRMDCNv2Config  # noqa: F401 - re-exported
from loka_trainer.models.mods import ResolvedMods, resolve_mods
from loka_trainer.models.sparse import SparseArch, build_ebc

PUBLISHED_MODS = ResolvedMods(bias=True, norm="none", activation="relu")


class InteractionArch(nn.Module):
    """Stacks the dense token with the sparse embeddings and applies ``interaction``.

    dense (B, D), sparse (B, F_s, D) -> (B, interaction.output_dim)
    """

    def __init__(self, interaction: nn.Module) -> None:
        super().__init__()
        self.interaction = interaction
        self.output_dim: int = interaction.output_dim

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.interaction(torch.cat([dense.unsqueeze(1), sparse], dim=1))  # tokens (B, m, D)


class DLRM(nn.Module):
    """sparse_arch (EBC) + dense_arch (bottom MLP -> D) -> inter_arch -> over_arch -> logits (B,)."""

    def __init__(
        self, *, sparse_arch: SparseArch, dense_arch: nn.Module, inter_arch: InteractionArch, over_arch: OverArch
    ) -> None:
        super().__init__()
        self.sparse_arch = sparse_arch
        self.dense_arch = dense_arch
        self.inter_arch = inter_arch
        self.over_arch = over_arch

    def forward(self, batch: Batch) -> torch.Tensor:
        dense = self.dense_arch(batch.dense)  # (B, D)
        sparse = self.sparse_arch(batch.sparse)  # (B, F_s, D)
        return self.over_arch(self.inter_arch(dense, sparse))  # (B,)

    def dense_units(self) -> list[nn.Module]:
        """FSDP2 units; the parameter-free dot interaction is not one."""
        units = [self.dense_arch, self.inter_arch, self.over_arch]
        return [u for u in units if any(True for _ in u.parameters())]


def _check_widths(cfg: DLRMConfig) -> None:
    if not cfg.dense_arch_widths or cfg.dense_arch_widths[-1] != cfg.embedding_dim:
        raise ValueError(
            f"model.dense_arch_widths must end with model.embedding_dim={cfg.embedding_dim}, "
            f"got {list(cfg.dense_arch_widths)}"
        )
    if not cfg.over_arch_widths:
        raise ValueError("model.over_arch_widths must list at least one width")


def _build(cfg: DLRMConfig, interaction: nn.Module, schema: DataSchema, mods: ResolvedMods) -> DLRM:
    _check_widths(cfg)
    inter_arch = InteractionArch(interaction)
    return DLRM(
        sparse_arch=SparseArch(build_ebc(schema, cfg.embedding_dim)),
        dense_arch=mlp(schema.num_dense, cfg.dense_arch_widths, **mods.layer_kwargs()),
        inter_arch=inter_arch,
        over_arch=OverArch(inter_arch.output_dim, cfg.over_arch_widths, **mods.layer_kwargs()),
    )


def build_dlrm(cfg: DLRMConfig, *, schema: DataSchema, loka_mods: bool) -> DLRM:
    """DLRM with the pairwise dot interaction."""
    mods = resolve_mods(cfg.mods, published=PUBLISHED_MODS, loka_mods=loka_mods)
    num_tokens = len(schema.sparse_features) + 1
    return _build(cfg, DotInteraction(num_tokens, cfg.embedding_dim, num_passthrough=1), schema, mods)


def build_dlrm_dcnv2(cfg: DLRMDCNv2Config, *, schema: DataSchema, loka_mods: bool) -> DLRM:
    """DLRM with a DCNv2 low-rank cross net over all flattened embeddings."""
    mods = resolve_mods(cfg.mods, published=PUBLISHED_MODS, loka_mods=loka_mods)
    num_tokens = len(schema.sparse_features) + 1
    cross = CrossInteraction(
        num_tokens, cfg.embedding_dim, num_layers=cfg.cross_layers, rank=cfg.cross_rank, bias=mods.bias
    )
    return _build(cfg, cross, schema, mods)
