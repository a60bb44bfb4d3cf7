"""Module factories for the Component Benchmark's command line, e.g.
``python -m loka_trainer.bench bench.provider=factory bench.factory=tests.bench.user_modules:two_towers``."""
from __future__ import annotations

import torch
from torch import nn


def two_towers(batch_size: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Two MLP towers over two inputs, summed: (B, 32), (B, 16) -> (B, 8)."""

    class TwoTowers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
            self.item = nn.Sequential(nn.Linear(16, 8))

        def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return self.user(u) + self.item(i)

    return TwoTowers(), (torch.randn(batch_size, 32), torch.randn(batch_size, 16))


def forward_raises(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    """A module whose forward raises on the input its factory gives."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.view(-1, 5))

    return Broken(), torch.randn(batch_size, 4)


def raises(batch_size: int):
    raise RuntimeError("no GPU here\nsecond line")


def returns_a_module(batch_size: int) -> nn.Module:
    return nn.Linear(4, 4)


NOT_CALLABLE = 3
