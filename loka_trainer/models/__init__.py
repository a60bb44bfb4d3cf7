"""Model zoo (DLRM dot / DCNv2, Wukong, InterFormer) with the LoKA Mods switches.

Entry point: ``build_model(model_cfg, *, schema, loka_mods)`` and the ``MODELS`` registry in ``zoo``.
"""
from __future__ import annotations

from loka_trainer.models.mods import ModsConfig, ResolvedMods, resolve_mods
from loka_trainer.models.zoo import MODELS, ModelSpec, build_model

__all__ = ["MODELS", "ModelSpec", "ModsConfig", "ResolvedMods", "build_model", "resolve_mods"]
