"""The model registry: ``model.name`` -> config schema and builder.

NOTE: the lead registers every ``ModelSpec.config_cls`` in Hydra's ConfigStore as group ``model``,
name ``f"{name}_schema"``; ``conf/model/<name>.yaml`` extends it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from torch import nn

from loka_trainer.data.batch import DataSchema
from loka_trainer.models.configs import MODEL_CONFIGS
from loka_trainer.models.mods import keep_biases, matching_linears
from loka_trainer.models.dlrm import build_dlrm, build_dlrm_dcnv2
from loka_trainer.models.interformer import build_interformer
from loka_trainer.models.wukong import build_wukong


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``build(cfg, *, schema, loka_mods) -> nn.Module`` for configs of type ``config_cls``."""

    config_cls: type
    build: Callable[..., nn.Module]


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "dlrm": build_dlrm,
    "dlrm_dcnv2": build_dlrm_dcnv2,
    "wukong": build_wukong,
    "interformer": build_interformer,
}
MODELS: dict[str, ModelSpec] = {name: ModelSpec(MODEL_CONFIGS[name], build) for name, build in _BUILDERS.items()}


def build_model(model_cfg: Any, *, schema: DataSchema, loka_mods: bool) -> nn.Module:
    """Build ``MODELS[model_cfg.name]`` on CPU.

    ``model_cfg`` is the typed config (``OmegaConf.to_object(cfg.model)``); ``loka_mods`` is True under
    ``precision=loka`` and turns on the LoKA Mods for every switch the config leaves at ``None``.
    """
    name = getattr(model_cfg, "name", None)
    if name not in MODELS:
        raise ValueError(f"model.name={name!r} is not one of {sorted(MODELS)}")
    spec = MODELS[name]
    if not isinstance(model_cfg, spec.config_cls):
        raise TypeError(
            f"model config for {name!r} must be a {spec.config_cls.__name__} (use OmegaConf.to_object), "
            f"got {type(model_cfg).__name__}"
        )
    model = spec.build(model_cfg, schema=schema, loka_mods=loka_mods)
    patterns = list(model_cfg.mods.keep_bias)
    # NOTE: a pattern that names only Linears that already have a bias is fine (e.g. a model's LoKA default
    # ``keep_bias`` under ``precision=bf16``); one that names no Linear at all is a typo.
    if patterns and not matching_linears(model, patterns):
        raise ValueError(f"model.mods.keep_bias={patterns} matches no nn.Linear of {name}")
    keep_biases(model, patterns, init=model_cfg.mods.keep_bias_init)
    return model
