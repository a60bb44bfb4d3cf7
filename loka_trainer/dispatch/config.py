"""LoKAConfig: what ``convert_to_loka`` does to a model (Mods fusion, Dispatch and how Dispatch measures).

The Hydra schema ``precision.PrecisionConfig`` extends it.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar, List, Optional

from loka_trainer.field_types import field_type_problem
from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION
from loka_trainer.probe.mere import DEFAULT_ZERO_FLOOR

COMPUTE_DTYPES = ("float32", "bfloat16")
DISPATCH_ONLY_FIELDS = ("plan", "probe_stats", "exclude", "backends")  # read by Dispatch alone (torchao: exclude)
# read only while Dispatch measures a plan: a loaded plan (``plan``) runs as it was measured
MEASUREMENT_FIELDS = ("probe_stats", "mere_threshold", "mere_zero_floor", "max_flushed_fraction", "min_speedup",
                      "timing_repeats", "timing_rounds", "timing_outlier_factor", "gpu_timer", "layer_timer")


@dataclasses.dataclass
class LoKAConfig:
    """The public converter's settings; ``validate()`` names the first bad field in one line."""

    mods: bool = True  # fuse each Linear -> BlockNorm -> HardSwish triple into one FusedLinearMods
    # per-layer, per-GEMM backend choice (MERE < mere_threshold, flushed <= max_flushed_fraction, speedup > min_speedup)
    dispatch: bool = True
    plan: Optional[str] = None  # path of a plan file to reuse (no re-measurement)
    probe_stats: Optional[str] = None  # the LoKA Probe's report.json, or the statistics dir holding it
    mere_threshold: float = 0.2
    # MERE's denominator floor, a fraction of mean |ref| (``probe.mere``; the report's ``--zero-floor``)
    mere_zero_floor: float = DEFAULT_ZERO_FLOOR
    # An FP8 candidate that casts more than this fraction of the nonzero values of a layer's real input or weight to
    # zero is rejected (``probe.flush``; 1 turns the check off). Gaussian-like activations flush ~1e-5 even with one
    # scale per tensor, an input whose scale an outlier channel sets flushes most of its values (84% on
    # docs/results/outliers_cpu's dense input).
    max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION
    min_speedup: float = 1.05
    min_features: int = 64  # only Linears with K and N >= this (and multiples of 16) are targets
    # fnmatch globs of Linear FQNs that stay BF16: not targets of Dispatch or of a uniform torchao recipe, and a
    # loaded plan's entries for them are dropped; a glob that names no target is an error (a typo)
    exclude: Optional[List[str]] = None
    # Dispatch keeps BF16 the Linears the model's modules name in their ``loka_keep_bf16`` (``dispatch.targets``;
    # the zoo's InterFormer: its weight generators, docs/results/quality_interformer_h200_keep_generators_bf16)
    keep_declared_bf16: bool = True
    backends: Optional[List[str]] = None  # restrict Dispatch candidates to these names (None: all available)
    timing_repeats: int = 5  # wall-clock repeats per GEMM when measuring on CPU
    # independent timing rounds per GEMM candidate, interleaved; a candidate must beat BF16 by min_speedup in every
    # round (``dispatch.select``)
    timing_rounds: int = 3
    timing_outlier_factor: float = 3.0  # a round slower than this × the median of the others is timed again
    gpu_timer: str = "cuda_events"  # how Dispatch times GEMM candidates on a GPU (``timing.GPU_TIMERS``)
    # how Dispatch times a fused Mods layer's whole step (its forward modes, its fused input grads) on a GPU: such
    # an eager step is host-bound (see ``timing.GPU_TIMERS``), so GPU time from graph replay by default
    layer_timer: str = "cuda_graph"
    compute_dtype: str = "bfloat16"  # dtype of the calibration inputs and weights Dispatch measures with
    compile: bool = False  # the model will run under torch.compile: Dispatch times fused layers compiled

    where: ClassVar[str] = "LoKAConfig"  # how error messages name this config

    def validate(self) -> "LoKAConfig":
        """Raise a one-line ValueError naming the field and the valid values; returns self."""
        at = self.where
        if (problem := field_type_problem(self, at)) is not None:
            raise ValueError(problem)
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{at}.compute_dtype: unknown {self.compute_dtype!r}; valid: {list(COMPUTE_DTYPES)}")
        if self.plan is not None and not Path(self.plan).is_file():
            what = "is not a file" if Path(self.plan).exists() else "does not exist"
            raise ValueError(f"{at}.plan: {str(self.plan)!r} {what}")
        if self.probe_stats is not None:  # its content is read and checked against the model where Dispatch reads it
            from loka_trainer.dispatch.probe_report import existing_report
            try:
                existing_report(self.probe_stats)
            except ValueError as exc:
                raise ValueError(f"{at}.probe_stats: {exc}") from None
        from loka_trainer.dispatch.plan import PLAN_SETTINGS  # lazy: keep the schema import-light
        for field, (valid, what) in PLAN_SETTINGS.items():  # the plan written with them must load again
            if not valid(getattr(self, field)):
                hint = " (1 turns the check off)" if field == "max_flushed_fraction" else ""
                raise ValueError(f"{at}.{field}: must be {what}{hint}, got {getattr(self, field)}")
        if not 0.0 <= self.mere_zero_floor < float("inf"):
            raise ValueError(f"{at}.mere_zero_floor: must be a finite number >= 0, got {self.mere_zero_floor}")
        if self.min_features < 16 or self.timing_repeats < 1:
            raise ValueError(f"{at}.min_features must be >= 16 and timing_repeats >= 1, got "
                             f"{self.min_features}, {self.timing_repeats}")
        if self.timing_rounds < 1 or not self.timing_outlier_factor > 1.0:
            raise ValueError(f"{at}.timing_rounds must be >= 1 and timing_outlier_factor > 1, got "
                             f"{self.timing_rounds}, {self.timing_outlier_factor}")
        from loka_trainer.timing import GPU_TIMERS  # lazy: keep the schema import-light
        for field in ("gpu_timer", "layer_timer"):
            if getattr(self, field) not in GPU_TIMERS:
                raise ValueError(f"{at}.{field}: unknown {getattr(self, field)!r}; valid: {sorted(GPU_TIMERS)}")
        if self.backends is not None:
            from loka_trainer.kernels.backends import BACKENDS
            bad = [b for b in self.backends if b not in BACKENDS]
            if bad:
                raise ValueError(f"{at}.backends: unknown {bad}; valid: {sorted(BACKENDS)}")
        return self

    def unread_with_plan(self) -> list[str]:
        """The measurement settings set away from their defaults that a loaded ``plan`` leaves unread."""
        if self.plan is None:
            return []
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name in MEASUREMENT_FIELDS if getattr(self, name) != defaults[name]]


# precision fields that only FP8 conversion reads (Dispatch or a torchao recipe); the rest (name, compute_dtype, mods,
# dispatch, fp8_recipe, compile) shape every run
FP8_SETTINGS = frozenset({*(f.name for f in dataclasses.fields(LoKAConfig)), "fp8_filter"}
                         - {"mods", "compute_dtype", "dispatch", "compile"})
TORCHAO_READS = frozenset({"min_features", "exclude", "fp8_filter"})  # configured_targets and the recipe's filter


def unread_precision_fields(dispatch: bool, fp8_recipe: Optional[str], plan: Optional[str]) -> frozenset[str]:
    """The ``precision`` fields a run does not read, from its composed ``precision.dispatch``, ``fp8_recipe`` and
    ``plan``: without Dispatch or a torchao recipe nothing is converted to FP8, so no ``FP8_SETTINGS`` field; a
    torchao recipe reads ``TORCHAO_READS`` alone; Dispatch reads no ``fp8_filter``, and with a loaded plan no setting
    of the measurement (``MEASUREMENT_FIELDS``: the plan runs as it was measured)."""
    if not dispatch and fp8_recipe is None:
        return FP8_SETTINGS
    if fp8_recipe is not None:
        return FP8_SETTINGS - TORCHAO_READS
    return frozenset({"fp8_filter", *(MEASUREMENT_FIELDS if plan is not None else ())})
