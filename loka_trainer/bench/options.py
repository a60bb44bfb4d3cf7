"""Typed options of a Component Benchmark run (the ``bench:`` section of ``conf/bench.yaml``).

Every option is checked when the options are built: a wrong type or an unknown name is one ValueError naming the
field and its valid values, before any model is built or any file written.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import torch

from loka_trainer.bench.profilers import PROFILERS
from loka_trainer.bench.results import RESULTS
from loka_trainer.field_types import field_type_problem
from loka_trainer.timing import BENCH_TIMERS

COLOR_BY = ("auto", "mfu", "bandwidth", "tflops")
PRECISIONS = ("auto", "fp32", "bf16", "fp8")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
DEVICE_SPELLINGS = "auto, cpu, cuda, cuda:N"
# smallest valid value of the integer fields
MINIMUMS = {"depth": 0, "batch_size": 0, "replicate": 1, "warmup": 0, "repeats": 1}


def choices() -> dict[str, Sequence[str]]:
    """Field -> its valid names (each element's, for a list field), from the plugin and timer registries."""
    return {"color_by": COLOR_BY, "precision": PRECISIONS, "timer": ("auto", *sorted(BENCH_TIMERS)),
            "profilers": sorted(PROFILERS), "results": sorted(RESULTS)}


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """depth: deepest module level profiled (root = 0); include/exclude: fnmatch globs on paths
    (``model.dense_arch*``), exclude drops a subtree, include limits which nodes are measured (others are
    estimated from children); both match a module on every path it has, so a shared (tied) module is one module:
    measured once, at its shallowest path, and dropped with any subtree it is in; replicate: batch replication
    factor; precision: auto = bf16 on CUDA, fp32 on CPU.
    List fields take a list or tuple of strings (a plain string is refused: ``results="csv"`` is not ``["csv"]``).
    """

    depth: int = 3
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    device: str = "auto"
    batch_size: int = 0  # 0: the data config's batch size
    replicate: int = 1
    precision: str = "auto"
    warmup: int = 3
    repeats: int = 10
    timer: str = "auto"
    profilers: tuple[str, ...] = ("params", "flops", "latency_fwd", "latency_fwd_bwd", "memory", "bandwidth")
    trace: bool = False
    memory_snapshot: bool = False
    results: tuple[str, ...] = ("csv", "json", "markdown", "icicle")
    color_by: str = "auto"
    root_name: str = "model"
    progress: bool = True

    def __post_init__(self) -> None:
        if (problem := field_type_problem(self, "bench")) is not None:
            raise ValueError(problem)
        for field in dataclasses.fields(self):
            if isinstance(value := getattr(self, field.name), list):
                object.__setattr__(self, field.name, tuple(value))
        for name, low in MINIMUMS.items():
            if getattr(self, name) < low:
                raise ValueError(f"bench.{name} must be >= {low}, got {getattr(self, name)}")
        for name, valid in choices().items():
            value = getattr(self, name)
            for item in value if isinstance(value, tuple) else (value,):
                if item not in valid:
                    raise ValueError(f"bench.{name}={item!r} is unknown; valid values: {list(valid)}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"bench.device={self.device!r} is unknown; valid values: {DEVICE_SPELLINGS}")
        if not self.root_name or "." in self.root_name:  # a path's parent is the path up to its last "."
            raise ValueError(f"bench.root_name={self.root_name!r}: must be a non-empty name without '.', "
                             f"e.g. 'model'")

    def resolved_precision(self, device: torch.device) -> str:
        if self.precision != "auto":
            return self.precision
        return "bf16" if device.type == "cuda" else "fp32"

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "BenchOptions":
        """From a plain mapping (e.g. ``OmegaConf.to_container(cfg.bench)``); unknown keys are a ValueError."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - fields)
        if unknown:
            raise ValueError(f"bench has unknown keys {unknown}; valid keys: {sorted(fields)}")
        return cls(**cfg)
