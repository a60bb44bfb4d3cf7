from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from loka_trainer.precision import PrecisionConfig

CONF = Path(__file__).resolve().parents[2] / "conf" / "precision"
NAMES = ["fp32", "bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp", "loka"]


@pytest.mark.parametrize("name", NAMES)
def test_yaml_matches_schema_and_validates(name):
    raw = OmegaConf.load(CONF / f"{name}.yaml")
    assert list(raw.pop("defaults")) == ["/precision_schema@_here_", "_self_"]
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), raw))
    assert cfg.validate().name == name
    assert (cfg.fp8_recipe is not None) == name.startswith("fp8_")
    assert cfg.dispatch == cfg.mods == (name == "loka")


@pytest.mark.parametrize("kwargs,match", [
    (dict(compute_dtype="fp16"), "precision.compute_dtype"),
    (dict(fp8_recipe="blockwise"), "precision.fp8_recipe"),
    (dict(fp8_recipe="rowwise", dispatch=True), "exclusive"),
    (dict(fp8_recipe="tensorwise", fp8_filter="small"), "precision.fp8_filter: unknown 'small'"),
    (dict(fp8_recipe="rowwise_with_gw_hp", fp8_filter="auto"), "precision.fp8_filter=auto supports the recipes"),
    (dict(plan="/nonexistent/plan.json"), "precision.plan"),
    (dict(probe_stats="/nonexistent"), "precision.probe_stats"),
    (dict(backends=["bf16", "warp_drive"]), "precision.backends"),
    (dict(mere_threshold=0.0), "precision.mere_threshold"),
    (dict(max_flushed_fraction=1.5), "precision.max_flushed_fraction: must be within \\[0, 1\\]"),
    (dict(max_flushed_fraction=-0.1), "precision.max_flushed_fraction: must be within \\[0, 1\\]"),
    (dict(max_flushed_fraction=float("nan")), "precision.max_flushed_fraction: must be within \\[0, 1\\]"),
    (dict(gpu_timer="stopwatch"), "precision.gpu_timer: unknown 'stopwatch'; valid: \\['cuda_events', 'cuda_graph'\\]"),
    (dict(layer_timer="sundial"), "precision.layer_timer: unknown 'sundial'; valid: \\['cuda_events', 'cuda_graph'\\]"),
])
def test_validate_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrecisionConfig(**kwargs).validate()


def test_the_flush_limit_reaches_dispatch_from_the_loka_preset():
    from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION
    raw = OmegaConf.load(CONF / "loka.yaml")
    raw.pop("defaults")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), raw,
                                              OmegaConf.from_dotlist(["max_flushed_fraction=0.2"])))
    assert PrecisionConfig().max_flushed_fraction == DEFAULT_MAX_FLUSHED_FRACTION == raw.max_flushed_fraction
    assert cfg.validate().loka_config().max_flushed_fraction == 0.2
