from __future__ import annotations

import torch

from loka_trainer.models.attention import MultiHeadAttention, PoolingByMultiheadAttention


def test_masked_keys_do_not_change_the_output():
    attention = MultiHeadAttention(8, 2, bias=True)
    query, keys = torch.randn(3, 4, 8), torch.randn(3, 6, 8)
    mask = torch.tensor([[True] * 6, [True, True, False, False, False, False], [False] * 5 + [True]])
    out = attention(query, keys, mask)
    noisy = keys.clone()
    noisy[~mask] = torch.randn(int((~mask).sum()), 8) * 100
    torch.testing.assert_close(attention(query, noisy, mask), out)
    noisy[0, 0] += 1.0  # an attended key does change it
    assert not torch.allclose(attention(query, noisy, mask)[0], out[0])


def test_shared_queries_equal_expanded_queries_and_pma_shape():
    attention = MultiHeadAttention(8, 4, bias=False)
    seeds, keys, mask = torch.randn(2, 8), torch.randn(5, 3, 8), torch.ones(5, 3, dtype=torch.bool)
    torch.testing.assert_close(attention(seeds, keys, mask), attention(seeds.expand(5, -1, -1), keys, mask))
    assert PoolingByMultiheadAttention(8, 3, 2, bias=False)(keys, mask).shape == (5, 3, 8)
