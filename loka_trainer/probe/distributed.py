"""Merging per-rank partial activation statistics with collectives (the only place the probe talks to ranks).

With n = sum_r n_r and mu = sum_r n_r mu_r / n, the pooled scatter is
  S = sum_r [S_r + n_r (mu_r - mu)(mu_r - mu)^T],
which is the Chan merge applied to all ranks at once, expressed as three all-reduce sums (plus a max).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from loka_trainer.probe.activation import Moments, _block_outer


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def all_reduce_moments(m: Moments) -> Moments:
    """Statistics of all ranks' rows, returned on every rank. Collective: every rank must call it, same order.

    m: count (), mean (K,), scatter (G, Kb, Kb), max_abs (K,) -> same shapes. No-op without a process group.
    """
    if not is_distributed():
        return m
    count = m.count.clone()
    dist.all_reduce(count)
    weighted_mean = m.mean * m.count
    dist.all_reduce(weighted_mean)
    mean = weighted_mean / count.clamp_min(1.0)
    scatter = m.scatter + m.count * _block_outer(m.mean - mean, m.block)
    dist.all_reduce(scatter)
    max_abs = m.max_abs.clone()
    dist.all_reduce(max_abs, op=dist.ReduceOp.MAX)
    return Moments(count, mean, scatter, max_abs)
