"""Typed options of a Component Benchmark run (the ``bench:`` section of ``conf/bench.yaml``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

COLOR_BY = ("auto", "mfu", "bandwidth", "tflops")
PRECISIONS = ("auto", "fp32", "bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """depth: deepest module level profiled (root = 0); include/exclude: fnmatch globs on paths
    (``model.dense_arch*``), exclude drops a subtree, include limits which nodes are measured (others are
    estimated from children); replicate: batch replication factor; precision: auto = bf16 on CUDA, fp32 on CPU.
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
        if self.depth < 0:
            raise ValueError(f"bench.depth must be >= 0, got {self.depth}")
        if self.color_by not in COLOR_BY:
            raise ValueError(f"bench.color_by={self.color_by!r} is unknown; valid values: {list(COLOR_BY)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"bench.precision={self.precision!r} is unknown; valid values: {list(PRECISIONS)}")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError(f"bench.warmup must be >= 0 and bench.repeats >= 1, got {self.warmup}, {self.repeats}")

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
        kw = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in cfg.items()}
        return cls(**kw)
