"""ProbeCallback under FSDP2 with 2 gloo processes: full weights seen in the hook, per-rank rows merged."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.callbacks.base import TrainState
from loka_trainer.callbacks.probe import ProbeCallback
from loka_trainer.probe.activation import batch_moments, merge_all
from loka_trainer.probe.distributed import all_reduce_moments
from loka_trainer.probe.stats_io import load_stats
from tests.spawn import run_on_ranks

WORLD, ROWS, STEPS = 2, 8, 3


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(100 * rank + step)) + rank


def _worker(rank: int, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
    assert type(model[0].weight).__name__ == "DTensor"  # outside forward: sharded
    probe = ProbeCallback(interval=1, save_interval=STEPS, out_dir=out_dir, tensorboard=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, rank=rank, world_size=WORLD)
    probe.on_train_start(state)
    for step in range(STEPS):
        state.step = step
        probe.on_step_start(state)
        model(_data(rank, step)).square().mean().backward()
        opt.step(); opt.zero_grad()
        probe.on_step_end(state)
    probe.on_train_end(state)
    # The collective merge equals one process merging every rank's batches.
    local = batch_moments(_data(rank, 0), block=16)
    merged = all_reduce_moments(local)
    expected = merge_all(batch_moments(_data(r, 0), block=16) for r in range(WORLD))
    torch.testing.assert_close(merged.scatter, expected.scatter, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(merged.mean, expected.mean)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_probe_under_fsdp2_with_two_ranks(tmp_path):
    run_on_ranks(_worker, WORLD, str(tmp_path))
    stats = load_stats(tmp_path)
    first = stats["layers"]["0"]
    assert stats["world_size"] == WORLD and stats["step"] == STEPS - 1
    assert float(first["activation"]["count"]) == WORLD * STEPS * ROWS  # both ranks' rows
    all_rows = torch.cat([_data(r, s) for r in range(WORLD) for s in range(STEPS)]).double()
    torch.testing.assert_close(first["activation"]["mean"], all_rows.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(first["activation"]["scatter"][0] / (len(all_rows) - 1), torch.cov(all_rows.T),
                               rtol=1e-4, atol=1e-5)
    assert tuple(first["weight"]["mean"].shape) == (32, 16)  # the full weight, not a shard
    assert first["weight"]["count"] == STEPS
