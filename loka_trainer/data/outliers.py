"""Outlier regime of the synthetic source: rare huge dense values and a few dense channels that are always large.

Notation: B batch, F_d dense features, H hot channels.

Production recommendation models have systematic outlier activations (a few feature channels always far larger
than the rest, plus rare extreme values); that is where uniform FP8 loses accuracy. With ``data.outliers`` on,
the model's dense input is

    dense'[b, f] = dense[b, f] * s_f                                  s_f = hot_scale on H seed-chosen channels, else 1
    dense'[b, f] = max(dense[b, f], 1) * s_f * 10**U(lo, hi)          with probability spike_rate (a spike)

with lo, hi = log10(spike_min), log10(spike_max): spikes are log-uniform between ``spike_min`` and ``spike_max``
times the value (at least 1, so a zero count spikes too). The teacher reads ``teacher_dense``: the channel scale
divided out and the value clipped at the largest regular count, so a spike reads as "a very large count" and the
labels stay a learnable function of what the model sees.
"""
from __future__ import annotations

import math

import torch

from loka_trainer.data.config import OutlierConfig
from loka_trainer.data.hashing import derive_seed, generator
from loka_trainer.data.sampling import MAX_DENSE_COUNT

# The largest dense value without outliers: log1p of the largest count.
MAX_REGULAR_DENSE = math.log1p(MAX_DENSE_COUNT)


def hot_channels(seed: int, num_dense: int, count: int) -> torch.Tensor:
    """The ``count`` dense channels that are always large, drawn from ``seed``. -> (H,) int64, sorted."""
    perm = torch.randperm(num_dense, generator=generator(derive_seed(seed, "outliers", "hot_channels")))
    return perm[:count].sort().values


def channel_scale(cfg: OutlierConfig, channels: torch.Tensor, num_dense: int) -> torch.Tensor:
    """Per-channel multiplier s: (F_d,) float32, ``hot_scale`` on ``channels`` and 1 elsewhere."""
    scale = torch.ones(num_dense)
    scale[channels] = cfg.hot_scale
    return scale


@torch.no_grad()
def inject_outliers(dense: torch.Tensor, cfg: OutlierConfig, scale: torch.Tensor,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the hot channels and the spikes. dense: (B, F_d) float32, scale: (F_d,).

    Returns (dense', spikes): (B, F_d) float32 and the (B, F_d) bool mask of spiked values.
    """
    shape = dense.shape
    hit = torch.rand(shape, generator=gen, dtype=torch.float64) < cfg.spike_rate
    lo, hi = math.log10(cfg.spike_min), math.log10(cfg.spike_max)
    factor = torch.pow(10.0, lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)).float()
    scaled = dense * scale
    spiked = dense.clamp_min(1.0) * scale * factor
    return torch.where(hit, spiked, scaled), hit


@torch.no_grad()
def teacher_dense(dense: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the teacher reads of an outlier batch: (B, F_d) -> (B, F_d), scale divided out, spikes clipped."""
    return (dense / scale).clamp(max=MAX_REGULAR_DENSE)
