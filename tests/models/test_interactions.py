from __future__ import annotations

import pytest
import torch

from loka_trainer.models.interactions import (
    INTERACTIONS,
    DotInteraction,
    LowRankCrossNet,
    build_interaction,
    pairwise_dots,
)
from loka_trainer.models.mods import LOKA_MODS


def test_pairwise_dots_match_loop():
    tokens = torch.randn(3, 5, 4)
    expected = torch.stack(
        [torch.stack([tokens[b, i] @ tokens[b, j] for i in range(5) for j in range(i + 1, 5)]) for b in range(3)]
    )
    torch.testing.assert_close(pairwise_dots(tokens), expected)


def test_dot_interaction_passthrough_and_width():
    tokens = torch.randn(2, 4, 3)
    out = DotInteraction(4, 3, num_passthrough=1)(tokens)
    assert out.shape == (2, 3 + 6)
    torch.testing.assert_close(out[:, :3], tokens[:, 0])


@pytest.mark.parametrize("bias", [True, False])
def test_low_rank_cross_net_formula(bias):
    net = LowRankCrossNet(6, num_layers=2, rank=3, bias=bias)
    x0 = torch.randn(4, 6)
    x = x0
    for down, up in zip(net.down, net.up):
        b = up.bias if bias else 0
        x = x0 * (x @ down.weight.T @ up.weight.T + b) + x
    torch.testing.assert_close(net(x0), x)
    assert all((up.bias is not None) == bias for up in net.up)


@pytest.mark.parametrize("name", sorted(INTERACTIONS))
def test_every_registered_interaction_reports_its_width(name):
    module = build_interaction(name, 5, 4, cross_layers=1, cross_rank=2, mods=LOKA_MODS)
    assert module(torch.randn(3, 5, 4)).shape == (3, module.output_dim)


def test_unknown_interaction_lists_valid_names():
    with pytest.raises(ValueError, match="inner_product"):
        build_interaction("dhen", 5, 4, cross_layers=1, cross_rank=2, mods=LOKA_MODS)
