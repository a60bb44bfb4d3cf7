"""LoKA Probe statistics: activation (Welford/Chan) and weight (matrix-normal) trackers, sampling, MERE, report.

Statistics only; the training-time driver is ``loka_trainer.callbacks.probe.ProbeCallback`` and the offline
analysis is ``python -m loka_trainer.probe.report STATS_DIR``.
"""
from __future__ import annotations

from loka_trainer.probe.activation import ActivationTracker, Moments, batch_moments, merge_all, merge_moments
from loka_trainer.probe.mere import exact_fp32_forward, mere
from loka_trainer.probe.sampling import sample_activations, sample_weight
from loka_trainer.probe.stats_io import AsyncSaver, atomic_save, load_stats, seal_stats
from loka_trainer.probe.targets import select_linears
from loka_trainer.probe.weight import WeightTracker, matrix_normal_update

__all__ = [
    "ActivationTracker", "AsyncSaver", "Moments", "WeightTracker", "atomic_save", "batch_moments",
    "exact_fp32_forward", "load_stats", "matrix_normal_update", "mere", "merge_all", "merge_moments",
    "sample_activations", "sample_weight", "seal_stats", "select_linears",
]
