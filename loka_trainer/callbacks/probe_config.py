"""``callbacks.probe``: the LoKA Probe's configuration (Hydra schema) and its validation."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Optional

from loka_trainer.field_types import field_type_problem
from loka_trainer.probe.activation import STATS_DTYPES


def probe_out_dir(out_dir: Optional[str], run_dir: Optional[Path]) -> Optional[Path]:
    """Where the Probe writes its statistics: ``callbacks.probe.out_dir``, default ``<run dir>/probe`` (None
    without either)."""
    if out_dir is not None:
        return Path(out_dir)
    return Path(run_dir) / "probe" if run_dir is not None else None


@dataclasses.dataclass
class ProbeConfig:
    """``callbacks.probe.*``. Hydra structured-config schema: only int/float/str/bool/Optional/List fields."""

    enabled: bool = False
    interval: int = 100  # observe one step's forward every `interval` steps
    save_interval: int = 10000  # write stats every `save_interval` steps (and at the end)
    include: Optional[List[str]] = None  # fnmatch globs on clean FQNs; None = all Linears
    exclude: Optional[List[str]] = None
    module_types: Optional[List[str]] = None  # class names (or base-class names); None = any nn.Linear
    min_features: int = 1  # skip layers with min(in_features, out_features) below this
    max_full_covariance: int = 4096  # wider inputs use a block-diagonal scatter
    # weight covariance factors (U: O x O, V: I x I) wider than this are diagonal: a full 4096-wide factor costs
    # ~10 s of CPU per observation (2 cores) and is estimated from tens of observations at most
    max_full_weight_factor: int = 1024
    covariance_block: int = 256  # block width of the block-diagonal representation
    # rows of an observed input folded into its mean and covariance (a uniform sample; 0 = every row): with every
    # row, an observed wukong_h200 step at batch 8192 spent 69 ms of H200 time in the scatters' fp32 GEMMs
    sample_rows: int = 2048
    momentum: float = 0.99  # weight (M, U, V) EMA momentum, paper: 0.9 to 0.99 (see probe.weight)
    stats_dtype: str = "float64"  # accumulator dtype: float64 | float32
    tensorboard: bool = True
    out_dir: Optional[str] = None  # default: <run_dir>/probe

    def validate(self) -> None:
        validate_config(self)


def validate_config(cfg: ProbeConfig) -> None:
    """One-line ValueError naming the field for anything of the wrong type or out of range."""
    if (problem := field_type_problem(cfg, "callbacks.probe")) is not None:
        raise ValueError(problem)
    for name in ("interval", "save_interval", "min_features", "max_full_covariance", "max_full_weight_factor",
                 "covariance_block"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"callbacks.probe.{name}={getattr(cfg, name)}; valid values: integers >= 1")
    if cfg.sample_rows < 0:
        raise ValueError(f"callbacks.probe.sample_rows={cfg.sample_rows}; valid values: 0 (every row) or >= 1")
    if not 0.0 < cfg.momentum < 1.0:
        raise ValueError(f"callbacks.probe.momentum={cfg.momentum}; valid values: 0 < momentum < 1 "
                         "(paper: 0.9 to 0.99)")
    if cfg.stats_dtype not in STATS_DTYPES:
        raise ValueError(f"callbacks.probe.stats_dtype={cfg.stats_dtype!r}; valid values: {', '.join(STATS_DTYPES)}")


def to_probe_config(fields: dict) -> ProbeConfig:
    """Keyword fields -> a validated ProbeConfig (unknown fields: one-line ValueError naming the valid ones)."""
    valid = {f.name for f in dataclasses.fields(ProbeConfig)}
    unknown = sorted(set(fields) - valid)
    if unknown:
        raise ValueError(f"unknown callbacks.probe field(s) {unknown}; valid fields: {', '.join(sorted(valid))}")
    fields = {k: (list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig" else v)
              for k, v in fields.items()}
    cfg = ProbeConfig(**fields)
    validate_config(cfg)
    return cfg
