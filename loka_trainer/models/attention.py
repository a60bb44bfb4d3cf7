"""Multi-head attention with plain ``nn.Linear`` projections (visible to Probe / Dispatch and to the
no-bias Mod), and Pooling by Multihead Attention (PMA, Set Transformer).

Notation: B batch, T_q query tokens, T_k key tokens, D model dim, H heads, n_s PMA seeds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over a key padding mask.

    query (B, T_q, D) or (T_q, D) shared by every row, key_value (B, T_k, D),
    key_mask (B, T_k) bool (True = attend) -> (B, T_q, D).
    NOTE: every row of ``key_mask`` needs at least one True (InterFormer's CLS tokens guarantee it),
    otherwise softmax over nothing gives NaN.
    """

    def __init__(self, dim: int, num_heads: int, *, bias: bool) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"model.embedding_dim={dim} must be divisible by model.num_heads={num_heads}")
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim, bias=bias)
        self.k = nn.Linear(dim, dim, bias=bias)
        self.v = nn.Linear(dim, dim, bias=bias)
        self.o = nn.Linear(dim, dim, bias=bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, H, T, D / H)

    def forward(self, query: torch.Tensor, key_value: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        q = self.q(query)
        if q.dim() == 2:  # shared queries: broadcast after the projection, one GEMM for all rows
            q = q.expand(key_value.shape[0], -1, -1)
        q, k, v = self._heads(q), self._heads(self.k(key_value)), self._heads(self.v(key_value))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])  # (B, H, T_q, D/H)
        return self.o(attended.transpose(1, 2).flatten(2))


class PoolingByMultiheadAttention(nn.Module):
    """``num_seeds`` learned queries attend over the tokens. tokens (B, T_k, D), mask (B, T_k) -> (B, n_s, D)"""

    def __init__(self, dim: int, num_seeds: int, num_heads: int, *, bias: bool) -> None:
        super().__init__()
        self.seeds = nn.Parameter(torch.randn(num_seeds, dim) * dim**-0.5)
        self.attention = MultiHeadAttention(dim, num_heads, bias=bias)

    def forward(self, tokens: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        # NOTE: pass the (n_s, D) leaf itself: an expanded view made under no_grad has no grad_fn
        # and breaks module hooks such as FlopCounterMode's module tracker.
        return self.attention(self.seeds, tokens, key_mask)
