"""Small example models for the Component Benchmark: an MLP tree and a nanoGPT-like transformer.

Notation: B batch, T sequence length, C channels, V vocabulary, H heads.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLPTree(nn.Module):
    """Two MLP branches whose outputs are concatenated and projected: (B, D) -> (B, 1)."""

    def __init__(self, d_in: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.right = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU())
        self.head = nn.Linear(2 * hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, D) -> (B, 1)"""
        return self.head(torch.cat([self.left(x), self.right(x)], dim=-1))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)"""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)"""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-shaped decoder: token + position embeddings, ``n_layer`` blocks, final norm, lm_head."""

    def __init__(self, vocab: int = 128, block_size: int = 32, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) int64 -> logits (B, T, V)"""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))
