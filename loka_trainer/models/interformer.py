"""InterFormer (arXiv 2411.09852): interleaved non-sequence / sequence learning with a Cross Arch.

Notation: B batch, F_d dense features, F_s sparse features, F_q sequence features,
T = schema.max_sequence_length, D embedding dim, n = num_dense_embeddings + F_s non-sequence tokens,
S = n_cls + T sequence tokens, n_xs / n_ss summary tokens (see ``interformer_arches``).

    X_0 = [dense MLP tokens || pooled sparse embeddings]                                  (B, n, D)
    S_0 = [CLS tokens || Linear(concat_q left_pad(seq_q))]   (newest item last), mask    (B, S, D)
    per layer:  X_sum, S_sum = Cross(X, S);  X = Interaction(X, S_sum);  S = Sequence(S, X_sum)
    logits = OverArch(flatten([Cross(X, S)]))

The paper merges several sequences with a MaskNet; here a Linear over the per-position
concatenation of the F_q sequences does that job (sequences are right-aligned, so position T-1-j is
the j-th newest item of every sequence).

Published defaults (``PUBLISHED_MODS``): biases on, LayerNorm, SiLU. Mods touch: bias of every
Linear (MLPs, sequence merge, PFFN, attention q/k/v/o, PMA, TokenMix, gates, cross nets; not the
prediction layer) and LayerNorm shifts; norm = MLP norms and the residual norms of the Interaction
and Sequence Arch; activation = every MLP activation. Softmax and the sigmoid gates keep their form.
NOTE: the config's default ``mods.keep_bias=[input_arch.merge]`` (``configs.interformer_mods``) gives the
sequence merge its bias back under the no-bias Mod: without it the model loses ~0.5% log loss (the only bias
that matters; measured in docs/results/interformer_mods_cpu).
"""
from __future__ import annotations


import torch
from torch import nn

from loka_trainer.data.batch import Batch, DataSchema
from loka_trainer.models.interformer_arches import CrossArch, SequenceArch, build_interaction_arch
from loka_trainer.models.layers import DenseEmbeddingArch, OverArch
from loka_trainer.models.configs import InterFormerConfig  # noqa: F401 - re-exported
from loka_trainer.models.mods import ResolvedMods, resolve_mods
from loka_trainer.models.sparse import SparseArch, build_ebc, build_ec, left_pad_jagged

PUBLISHED_MODS = ResolvedMods(bias=True, norm="layernorm", activation="silu")


class InputArch(nn.Module):
    """Dense tokens and the merged, CLS-prefixed sequence.

    dense (B, F_d), sequences: F_q pairs (values (L_q, D), lengths (B,)) ->
    X_dense (B, n_d, D), S_0 (B, n_cls + T, D), mask (B, n_cls + T) bool.
    """

    def __init__(
        self, dense_arch: DenseEmbeddingArch, *, num_sequences: int, dim: int, max_length: int, num_cls: int, bias: bool
    ) -> None:
        super().__init__()
        self.dense_arch = dense_arch
        self.max_length = max_length
        self.merge = nn.Linear(num_sequences * dim, dim, bias=bias)
        self.cls_tokens = nn.Parameter(torch.randn(num_cls, dim) * dim**-0.5)

    def forward(
        self, dense: torch.Tensor, sequences: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        padded = [left_pad_jagged(values, lengths, self.max_length) for values, lengths in sequences]
        merged = self.merge(torch.cat([p for p, _ in padded], dim=-1))  # (B, T, D)
        valid = torch.stack([m for _, m in padded]).any(0)  # (B, T): any sequence has an item there
        merged = merged * valid.unsqueeze(-1).to(merged.dtype)
        cls = self.cls_tokens.unsqueeze(0).expand(dense.shape[0], -1, -1)  # (B, n_cls, D)
        mask = torch.cat([valid.new_ones(cls.shape[:2]), valid], dim=1)
        return self.dense_arch(dense), torch.cat([cls, merged], dim=1), mask


class InterFormerLayer(nn.Module):
    """Cross -> (Interaction, Sequence) in parallel on the previous layer's X and S."""

    def __init__(self, cross_arch: CrossArch, inter_arch: nn.Module, seq_arch: SequenceArch) -> None:
        super().__init__()
        self.cross_arch = cross_arch
        self.inter_arch = inter_arch
        self.seq_arch = seq_arch

    def forward(self, x: torch.Tensor, s: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_sum, s_sum = self.cross_arch(x, s, mask)
        return self.inter_arch(x, s_sum), self.seq_arch(s, mask, x_sum)


class HeadArch(nn.Module):
    """Final Cross Arch summaries -> OverArch. x (B, n, D), s (B, S, D), mask -> logits (B,)"""

    def __init__(self, cross_arch: CrossArch, over_arch: OverArch) -> None:
        super().__init__()
        self.cross_arch = cross_arch
        self.over_arch = over_arch

    def forward(self, x: torch.Tensor, s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x_sum, s_sum = self.cross_arch(x, s, mask)
        return self.over_arch(torch.cat([x_sum, s_sum], dim=1).flatten(1))


class InterFormer(nn.Module):
    """sparse_arch (EBC + EC) + input_arch -> layers -> head_arch -> logits (B,)."""

    def __init__(
        self, *, sparse_arch: SparseArch, input_arch: InputArch, layers: nn.ModuleList, head_arch: HeadArch
    ) -> None:
        super().__init__()
        self.sparse_arch = sparse_arch
        self.input_arch = input_arch
        self.layers = layers
        self.head_arch = head_arch

    def forward(self, batch: Batch) -> torch.Tensor:
        if batch.sequences is None:
            raise ValueError("model=interformer needs batch.sequences; use a data source with sequence_features")
        sequences = list(self.sparse_arch.sequences(batch.sequences).values())
        x_dense, s, mask = self.input_arch(batch.dense, sequences)
        x = torch.cat([x_dense, self.sparse_arch(batch.sparse)], dim=1)  # (B, n, D)
        for layer in self.layers:
            x, s = layer(x, s, mask)
        return self.head_arch(x, s, mask)

    def dense_units(self) -> list[nn.Module]:
        return [self.input_arch, *self.layers, self.head_arch]


def _check(cfg: InterFormerConfig, schema: DataSchema) -> None:
    if cfg.num_layers < 1:
        raise ValueError(f"model.num_layers must be >= 1, got {cfg.num_layers}")
    if not 0 < cfg.num_recent_tokens <= schema.max_sequence_length:
        raise ValueError(
            f"model.num_recent_tokens={cfg.num_recent_tokens} must be in [1, data max_sequence_length="
            f"{schema.max_sequence_length}]"
        )
    if cfg.num_cls_tokens < 1:
        raise ValueError(f"model.num_cls_tokens must be >= 1 (they keep attention defined), got {cfg.num_cls_tokens}")


def _cross_arch(cfg: InterFormerConfig, num_tokens: int, mods: ResolvedMods) -> CrossArch:
    return CrossArch(
        num_tokens,
        cfg.embedding_dim,
        num_summary=cfg.num_summary_embeddings,
        num_cls=cfg.num_cls_tokens,
        num_pma=cfg.num_pma_seeds,
        num_recent=cfg.num_recent_tokens,
        num_heads=cfg.num_heads,
        mods=mods,
    )


def _layer(cfg: InterFormerConfig, num_tokens: int, mods: ResolvedMods) -> InterFormerLayer:
    cross = _cross_arch(cfg, num_tokens, mods)
    inter = build_interaction_arch(
        cfg.interaction,
        num_tokens,
        cross.num_s_summary,
        cfg.embedding_dim,
        widths=cfg.interaction_widths,
        cross_layers=cfg.cross_layers,
        cross_rank=cfg.cross_rank,
        mods=mods,
    )
    seq = SequenceArch(cfg.num_summary_embeddings, cfg.embedding_dim, cfg.num_heads, cfg.pffn_widths, mods)
    return InterFormerLayer(cross, inter, seq)


def build_interformer(cfg: InterFormerConfig, *, schema: DataSchema, loka_mods: bool) -> InterFormer:
    """InterFormer sized by ``cfg`` over the features and sequences of ``schema``."""
    _check(cfg, schema)
    mods = resolve_mods(cfg.mods, published=PUBLISHED_MODS, loka_mods=loka_mods)
    d, num_tokens = cfg.embedding_dim, cfg.num_dense_embeddings + len(schema.sparse_features)
    dense_arch = DenseEmbeddingArch(
        schema.num_dense, cfg.dense_arch_widths, cfg.num_dense_embeddings, d, **mods.layer_kwargs()
    )
    head_cross = _cross_arch(cfg, num_tokens, mods)
    over_in = (cfg.num_summary_embeddings + head_cross.num_s_summary) * d
    return InterFormer(
        sparse_arch=SparseArch(build_ebc(schema, d), build_ec(schema, d)),
        input_arch=InputArch(
            dense_arch,
            num_sequences=len(schema.sequence_features),
            dim=d,
            max_length=schema.max_sequence_length,
            num_cls=cfg.num_cls_tokens,
            bias=mods.bias,
        ),
        layers=nn.ModuleList(_layer(cfg, num_tokens, mods) for _ in range(cfg.num_layers)),
        head_arch=HeadArch(head_cross, OverArch(over_in, cfg.over_arch_widths, **mods.layer_kwargs())),
    )
