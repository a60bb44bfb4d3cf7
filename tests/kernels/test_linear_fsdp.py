"""LoKALinear under FSDP2 on 2 gloo ranks: the cached FP8 weight follows every optimizer step (never stale)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.kernels.backend_base import GEMMS
from loka_trainer.kernels.linear import LoKALinear, WeightCache, register_weight_cache_hook
from tests.spawn import run_on_ranks

WORLD, STEPS = 2, 3


def _expected(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward computed from ``weight`` (full, current) with a fresh cache."""
    fresh = LoKALinear(weight.shape[1], weight.shape[0], bias=False, backends={g: "scaled_mm_rowwise" for g in GEMMS})
    fresh.weight.data.copy_(weight)
    fresh._weight_cache = WeightCache()
    with torch.no_grad():
        return fresh(x)


def _worker(rank: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(LoKALinear(64, 32, bias=False, backends={g: "scaled_mm_rowwise" for g in GEMMS}))
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    register_weight_cache_hook(model, opt)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(STEPS):
        y = model(x)
        full = model[0].weight.full_tensor().detach()  # outside the forward: the current full weight
        torch.testing.assert_close(y.detach(), _expected(full, x), rtol=0, atol=0)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.timeout(120)
def test_cached_fp8_weight_follows_optimizer_steps_under_fsdp2():
    run_on_ranks(_worker, WORLD)
