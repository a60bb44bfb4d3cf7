"""The trainer's precision transform: ``PrecisionConfig`` (the Hydra schema of the ``precision`` group, fp32 ...
loka) and ``apply_precision``, called once on the model before sharding.

Presets (``conf/precision/<name>.yaml``):
- ``fp32``, ``bf16``: nothing here; bf16 autocasts the dense part (the trainer's job, from ``compute_dtype``).
- ``fp8_tensorwise`` / ``fp8_rowwise`` / ``fp8_rowwise_gw_hp``: uniform torchao ``Float8Linear`` with that
  recipe on every target Linear (``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``;
  the baselines LoKA must beat). ``fp8_filter=auto`` keeps FP8 off the shapes torchao's own benchmarks found
  slower in FP8 (``FP8_FILTERS``), as torchtitan's ``auto_filter_small_kn`` applies the recipe: the speed baseline;
  ``all`` is uniform FP8, the quality baseline.
- ``loka``: ``convert_to_loka`` (Mods on + Dispatch: per-layer, per-GEMM backend choice; plan file reusable
  via ``plan``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn

from loka_trainer.dispatch.broadcast import rank0_print
from loka_trainer.dispatch.config import TORCHAO_READS, LoKAConfig, unread_precision_fields
from loka_trainer.dispatch.convert import convert_to_loka
from loka_trainer.dispatch.plan import DispatchPlan
from loka_trainer.dispatch.targets import ModuleFilter, configured_targets, drop_unaligned_rows
from loka_trainer.kernels.backend_base import emulates_fp8
from loka_trainer.module_names import canonical_fqns, canonical_named_modules

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LinearFilter = Callable[[nn.Module, str], bool]


def _torchao_auto_filter(recipe: str) -> LinearFilter:
    from torchao.float8 import _auto_filter_for_recipe  # noqa: PLC0415 -- torchao imports slowly
    return _auto_filter_for_recipe(recipe, filter_fqns=[])


# precision.fp8_filter -> (recipe -> the extra test a target Linear must pass to be converted, or None: all), and
# the recipes it supports. "auto": torchao's size thresholds per recipe (tensorwise: not K <= 4096 and N <= 1024;
# rowwise: N > 2048, K > 1024, not both N <= 4096 and K <= 2048), from its H100 benchmarks.
FP8_FILTERS: dict[str, tuple[Callable[[str], Optional[LinearFilter]], tuple[str, ...]]] = {
    "all": (lambda recipe: None, FP8_RECIPES),
    "auto": (_torchao_auto_filter, ("tensorwise", "rowwise")),
}


@dataclasses.dataclass
class PrecisionConfig(LoKAConfig):
    """Hydra schema ``precision``: the ``LoKAConfig`` fields (off by default: fp32) plus the preset's ``name`` and a
    uniform torchao recipe. ``compile`` is set by the trainer from ``trainer.compile`` (``loka_config``)."""

    name: str = "fp32"
    compute_dtype: str = "float32"  # autocast dtype of the dense part
    mods: bool = False  # LoKA Mods fusion (the zoo builds the Mods layers themselves from ``model.mods``)
    dispatch: bool = False
    fp8_recipe: Optional[str] = None  # uniform torchao recipe, one of FP8_RECIPES
    fp8_filter: str = "all"  # which target Linears the torchao recipe converts: FP8_FILTERS

    where: ClassVar[str] = "precision"

    def validate(self) -> "PrecisionConfig":
        """``LoKAConfig.validate`` plus the torchao recipe; raises a one-line ValueError; returns self."""
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"precision.fp8_recipe: unknown {self.fp8_recipe!r}; valid: {list(FP8_RECIPES)} or null")
        if self.fp8_filter not in FP8_FILTERS:
            raise ValueError(f"precision.fp8_filter: unknown {self.fp8_filter!r}; valid: {sorted(FP8_FILTERS)}")
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_FILTERS[self.fp8_filter][1]:
            raise ValueError(f"precision.fp8_filter={self.fp8_filter} supports the recipes "
                             f"{list(FP8_FILTERS[self.fp8_filter][1])}, not {self.fp8_recipe!r}")
        if self.fp8_recipe is not None and self.dispatch:
            raise ValueError("precision.fp8_recipe and precision.dispatch are exclusive; set one of them")
        super().validate()
        return self

    def loka_config(self, **overrides) -> LoKAConfig:
        """The ``LoKAConfig`` part of this preset (``overrides`` replace fields, e.g. ``compile``)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(LoKAConfig)}
        return LoKAConfig(**{**shared, **overrides})


def _apply_torchao(model: nn.Module, recipe: str, linears: dict[str, nn.Linear], device) -> None:
    """torchao's recipe on ``linears`` (canonical FQN -> Linear, ``module_names``), with torchao's ``emulate``
    where ``emulates_fp8(device)``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    targets = set(linears)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulates_fp8(device))
    names = canonical_fqns(model)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: names.get(fqn) in targets)
    if torch.device(device).type == "cpu" and _has_high_precision_gemm(config):
        for fqn, module in canonical_named_modules(model):
            if fqn in targets:
                module.register_forward_pre_hook(_input_in_cpu_autocast_dtype)


def _has_high_precision_gemm(config) -> bool:
    """Whether a GEMM of torchao's ``Float8LinearConfig`` takes an operand unscaled, in its own dtype
    (rowwise_with_gw_hp's weight gradient)."""
    from torchao.float8.config import ScalingType  # noqa: PLC0415 -- torchao imports slowly

    casts = [getattr(config, f.name) for f in dataclasses.fields(config) if f.name.startswith("cast_config_")]
    return any(cast.scaling_type is ScalingType.DISABLED for cast in casts)


def _input_in_cpu_autocast_dtype(module: nn.Module, args: tuple) -> Optional[tuple]:
    """Forward pre-hook of a torchao ``Float8Linear``: under CPU autocast its input (N, K) in the autocast dtype.
    torchao casts it under CUDA autocast only; on the CPU an FP32 input then meets the BF16 output gradient in
    the high-precision weight-gradient GEMM, which fails in backward. Registered for a CPU model only."""
    if not args or not torch.is_autocast_enabled("cpu") or args[0].device.type != "cpu":
        return None
    x, *rest = args
    return (x.to(torch.get_autocast_dtype("cpu")), *rest)


# who reads a precision setting that a preset without Dispatch leaves unread (``unread_precision_fields``), in the
# order the log line names them
DISPATCH, BOTH, TORCHAO = ("Dispatch: precision=loka", "Dispatch and the torchao presets",
                           "the torchao presets: precision=fp8_*")


def _reader(field: str) -> str:
    return TORCHAO if field == "fp8_filter" else BOTH if field in TORCHAO_READS else DISPATCH


def unread_by_preset(config: PrecisionConfig) -> dict[str, list[str]]:
    """Reader -> the settings of a preset without Dispatch that it leaves unread (``unread_precision_fields``), set
    away from their defaults; a shared override list (a benchmark's runs) may set them for every precision, so they
    are named, not refused."""
    unread = unread_precision_fields(config.dispatch, config.fp8_recipe, config.plan)
    named = [f.name for f in dataclasses.fields(PrecisionConfig)
             if f.name in unread and getattr(config, f.name) != f.default]
    groups = {reader: [f"precision.{f}" for f in named if _reader(f) == reader] for reader in (DISPATCH, BOTH, TORCHAO)}
    return {reader: fields for reader, fields in groups.items() if fields}


# preset -> what it runs as (``runs_as``): a preset whose defining setting is overridden away runs as another
# precision under its own name, which train.log then says (bf16_mods: precision=loka precision.dispatch=false)
PRESET_RUNS_AS = {"fp32": "float32", "bf16": "bfloat16 autocast", "fp8_tensorwise": "torchao float8 tensorwise",
                  "fp8_rowwise": "torchao float8 rowwise", "fp8_rowwise_gw_hp": "torchao float8 rowwise_with_gw_hp",
                  "loka": "LoKA Dispatch"}


def runs_as(config: PrecisionConfig) -> tuple[str, str]:
    """What ``config`` runs as (a torchao recipe, Dispatch, else the dense part's compute dtype, with the Mods when
    on) and the settings that decide it, as overrides."""
    if config.fp8_recipe is not None:
        return f"torchao float8 {config.fp8_recipe}", f"precision.fp8_recipe={config.fp8_recipe}"
    if config.dispatch:
        return "LoKA Dispatch", "precision.dispatch=true"
    plain = "float32" if config.compute_dtype == "float32" else f"{config.compute_dtype} autocast"
    return (f"{plain} with the Mods" if config.mods else plain,
            f"precision.fp8_recipe=null, precision.dispatch=false, precision.compute_dtype={config.compute_dtype}")


def precision_identity(config: PrecisionConfig) -> dict[str, Any]:
    """What decides a run's numerics beside its model (`resume.model_identity` holds ``precision.mods``), as JSON:
    the preset's ``name``, what it runs as (`runs_as`), whether Dispatch chooses its kernels (then its plan file
    decides them: `dispatch.reuse` holds a resumed run to it) and ``settings``: the dense part's compute dtype and,
    under a torchao recipe, which Linears it converts (``TORCHAO_READS``). A checkpoint records it; a resume under
    another one is named in one line (`resume.precision_change`)."""
    reads = sorted(TORCHAO_READS) if config.fp8_recipe is not None else []
    settings = {f"precision.{name}": getattr(config, name) for name in ["compute_dtype", *reads]}
    return json.loads(json.dumps({"name": config.name, "runs_as": runs_as(config)[0],
                                  "dispatch": bool(config.dispatch), "settings": settings}))


def not_as_named(config: PrecisionConfig) -> Optional[str]:
    """A line for train.log when a preset's defining setting is overridden away (``precision.fp8_recipe=null`` on
    fp8_*, ``precision.dispatch=false`` on loka): the run keeps the preset's name and runs as another precision.
    Named, not refused: variants are presets plus overrides (bf16_mods is loka without Dispatch), and a shared
    override list (a benchmark's runs) may set them for every precision, as ``unread_by_preset`` names its."""
    promised = PRESET_RUNS_AS.get(config.name)
    actual, settings = runs_as(config)
    if promised is None or actual.startswith(promised):  # the Mods on bf16 are the model's (model.mods)
        return None
    return (f"precision={config.name} runs as {actual}, not {promised} ({settings}); summary.json and the logs "
            f"keep the name {config.name}")


def apply_precision(model: nn.Module, *, config: PrecisionConfig, device, calibration_batch=None,
                    run_dir: Optional[Path] = None, module_filter_fn: Optional[ModuleFilter] = None,
                    compile: bool = False, log: Callable[[str], None] = rank0_print) -> Optional[DispatchPlan]:
    """Transform ``model`` in place for ``config``: torchao's uniform recipe, or ``convert_to_loka`` when Dispatch
    is on (``compile``: the model will be compiled); returns the Dispatch plan then, else None."""
    config.validate()
    if not config.dispatch and (unread := unread_by_preset(config)):
        log(f"precision={config.name}: ignores " + "; ".join(f"{', '.join(fields)} (read by {reader})"
                                                            for reader, fields in unread.items()))
    if line := not_as_named(config):
        log(line)
    if config.fp8_recipe is not None:
        linears = configured_targets(model, config, module_filter_fn=module_filter_fn, log=log)
        linears = drop_unaligned_rows(model, linears, calibration_batch, log)
        keep = FP8_FILTERS[config.fp8_filter][0](config.fp8_recipe)
        if keep is not None:
            linears = {fqn: m for fqn, m in linears.items() if keep(m, fqn)}
        _apply_torchao(model, config.fp8_recipe, linears, device)
        log(f"precision={config.name}: torchao float8 '{config.fp8_recipe}' on {len(linears)} Linear(s) "
            f"(fp8_filter={config.fp8_filter})")
        return None
    if not config.dispatch:
        return None
    return convert_to_loka(model, config.loka_config(compile=compile), calibration_batch=calibration_batch,
                           module_filter_fn=module_filter_fn, device=device, run_dir=run_dir, log=log)
