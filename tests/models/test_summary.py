from __future__ import annotations

import pytest
import torch

from loka_trainer.models.summary import count_parameters, dense_flops_per_example
from loka_trainer.models.zoo import MODELS, build_model


def test_count_parameters_splits_embeddings_from_dense(schema, small_config):
    model = build_model(small_config("dlrm"), schema=schema, loka_mods=False)
    counts = count_parameters(model)
    assert counts["sparse"] == sum(schema.sparse_vocab_sizes) * 8
    assert counts["dense"] == sum(p.numel() for unit in model.dense_units() for p in unit.parameters())


def test_dlrm_dense_flops_match_the_analytic_count(schema, batch, small_config):
    model = build_model(small_config("dlrm"), schema=schema, loka_mods=False)
    num_tokens, dim = len(schema.sparse_features) + 1, 8
    linear_macs = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    expected = 2 * (linear_macs + num_tokens * num_tokens * dim)  # + the Gram matrix of the dot interaction
    assert dense_flops_per_example(model, batch) == pytest.approx(expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flops_grow_with_width_and_ignore_batch_size(name, schema, make_batch, small_config):
    torch.manual_seed(0)
    small = build_model(small_config(name), schema=schema, loka_mods=True)
    wide = build_model(small_config(name, over_arch_widths=[256]), schema=schema, loka_mods=True)
    flops_4 = dense_flops_per_example(small, make_batch(schema, 4))
    flops_8 = dense_flops_per_example(small, make_batch(schema, 8))
    # rel: InterFormer projects its shared PMA queries once per batch, not once per example
    assert flops_4 == pytest.approx(flops_8, rel=0.01) and flops_4 > 0
    assert dense_flops_per_example(wide, make_batch(schema, 4)) > flops_4


def test_attention_flops_are_counted_on_cpu_too():
    from loka_trainer.models.attention import MultiHeadAttention

    class _Wrap(torch.nn.Module):  # dense_flops_per_example calls model(batch) and divides by len(batch)
        def __init__(self):
            super().__init__()
            self.attention = MultiHeadAttention(8, 2, bias=False)

        def forward(self, tokens):
            return self.attention(tokens, tokens, torch.ones(tokens.shape[:2], dtype=torch.bool))

    tokens = torch.randn(4, 10, 8)
    projections = 4 * 2 * 10 * 8 * 8  # q, k, v, o per example
    scores_and_mix = 2 * 2 * 2 * 10 * 10 * 4  # QK^T and AV, 2 heads of dim 4
    assert dense_flops_per_example(_Wrap(), tokens) == pytest.approx(projections + scores_and_mix)
