"""A plain DDP loop building ``TrainState(model=model)`` as the docs show: the Probe acts as rank 0 on rank 0 only."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.callbacks.base import TrainState
from loka_trainer.callbacks.probe import ProbeCallback
from loka_trainer.probe.stats_io import load_stats
from tests.spawn import run_on_ranks

WORLD, STEPS = 2, 2


def _worker(rank: int, out_dir: str) -> None:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = ProbeCallback(interval=1, save_interval=STEPS, out_dir=out_dir)
    state = TrainState(model=model)  # no rank or world_size given
    assert (state.rank, state.world_size) == (rank, WORLD)
    probe.on_train_start(state)
    assert (probe.writer is not None) == (rank == 0)  # one TensorBoard writer, on rank 0
    for step in range(STEPS):
        state.step = step
        probe.on_step_start(state)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        probe.on_step_end(state)
    probe.on_train_end(state)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_state_takes_rank_and_world_size_from_the_process_group(tmp_path):
    run_on_ranks(_worker, WORLD, str(tmp_path / "probe"))
    stats = load_stats(tmp_path / "probe")
    assert stats["world_size"] == WORLD
    assert float(stats["layers"]["0"]["activation"]["count"]) == WORLD * STEPS * 4


def test_train_state_without_a_process_group_is_rank_0_of_1():
    state = TrainState(model=nn.Linear(2, 2))
    assert (state.rank, state.world_size) == (0, 1)
