"""PrecisionConfig: the Hydra structured-config schema of the ``precision`` group (fp32 ... loka).

Presets (``conf/precision/<name>.yaml``):
- ``fp32``, ``bf16``: no FP8; bf16 autocasts the dense part.
- ``fp8_tensorwise`` / ``fp8_rowwise`` / ``fp8_rowwise_gw_hp``: uniform torchao ``Float8Linear`` with that
  recipe on every target Linear (the baselines LoKA must beat).
- ``loka``: Mods on + Dispatch (per-layer, per-GEMM backend choice; plan file reusable via ``plan``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Optional

from loka_trainer.probe.mere import DEFAULT_ZERO_FLOOR

COMPUTE_DTYPES = ("float32", "bfloat16")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclasses.dataclass
class PrecisionConfig:
    name: str = "fp32"
    compute_dtype: str = "float32"  # autocast dtype of the dense part
    mods: bool = False  # LoKA Mods (no bias, BlockNorm, HardSwish) on by default for the model
    fp8_recipe: Optional[str] = None  # uniform torchao recipe, one of FP8_RECIPES
    dispatch: bool = False  # LoKA Dispatch: per-layer, per-GEMM backend choice
    plan: Optional[str] = None  # path of a plan file to reuse (no re-measurement)
    probe_stats: Optional[str] = None  # LoKA Probe statistics dir holding report.json
    mere_threshold: float = 0.2
    # MERE's denominator floor, a fraction of mean |ref| (``probe.mere``; the report's ``--zero-floor``)
    mere_zero_floor: float = DEFAULT_ZERO_FLOOR
    min_speedup: float = 1.05
    min_features: int = 64  # only Linears with K and N >= this (and multiples of 16) are targets
    backends: Optional[List[str]] = None  # restrict Dispatch candidates to these names (None: all available)
    timing_repeats: int = 5  # wall-clock repeats per GEMM when measuring on CPU
    gpu_timer: str = "cuda_events"  # how Dispatch times candidates on a GPU (``dispatch.GPU_TIMERS``)
    # how Dispatch times a fused Mods layer's whole step (its forward modes, its fused input grads) on a GPU: such
    # an eager step is host-bound (see ``dispatch.GPU_TIMERS``), so GPU time from graph replay by default
    layer_timer: str = "cuda_graph"

    def validate(self) -> "PrecisionConfig":
        """Raise a one-line ValueError naming the field and the valid values; returns self."""
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"precision.compute_dtype: unknown {self.compute_dtype!r}; valid: {list(COMPUTE_DTYPES)}")
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"precision.fp8_recipe: unknown {self.fp8_recipe!r}; valid: {list(FP8_RECIPES)} or null")
        if self.fp8_recipe is not None and self.dispatch:
            raise ValueError("precision.fp8_recipe and precision.dispatch are exclusive; set one of them")
        if self.plan is not None and not Path(self.plan).is_file():
            raise ValueError(f"precision.plan: file {self.plan!r} does not exist")
        if self.probe_stats is not None and not (Path(self.probe_stats) / "report.json").is_file():
            raise ValueError(f"precision.probe_stats: {self.probe_stats!r} has no report.json "
                             f"(run `python -m loka_trainer.probe.report {self.probe_stats}`)")
        if not 0.0 < self.mere_threshold:
            raise ValueError(f"precision.mere_threshold: must be > 0, got {self.mere_threshold}")
        if not 0.0 <= self.mere_zero_floor < float("inf"):
            raise ValueError(f"precision.mere_zero_floor: must be a finite number >= 0, got {self.mere_zero_floor}")
        if not self.min_speedup > 0.0:
            raise ValueError(f"precision.min_speedup: must be > 0, got {self.min_speedup}")
        if self.min_features < 16 or self.timing_repeats < 1:
            raise ValueError(f"precision.min_features must be >= 16 and timing_repeats >= 1, got "
                             f"{self.min_features}, {self.timing_repeats}")
        from loka_trainer.kernels.dispatch import GPU_TIMERS  # lazy: keep the schema import-light
        for field in ("gpu_timer", "layer_timer"):
            if getattr(self, field) not in GPU_TIMERS:
                raise ValueError(f"precision.{field}: unknown {getattr(self, field)!r}; valid: {sorted(GPU_TIMERS)}")
        if self.backends is not None:
            from loka_trainer.kernels.backends import BACKENDS
            bad = [b for b in self.backends if b not in BACKENDS]
            if bad:
                raise ValueError(f"precision.backends: unknown {bad}; valid: {sorted(BACKENDS)}")
        return self
