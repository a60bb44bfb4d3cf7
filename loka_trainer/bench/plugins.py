"""The four plugin interfaces of the Component Benchmark (paper III-A3) and the job they pass along.

Add a plugin by subclassing one of these and putting the class in the matching registry
(``PROVIDERS``, ``PREPROCESSORS``, ``PROFILERS``, ``RESULTS``) or passing an instance to ``run_bench``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
from torch import nn

from loka_trainer.bench.metrics import DevicePeak
from loka_trainer.bench.tree import BenchResult, ModuleInputs


@dataclasses.dataclass
class Component:
    """What a provider hands over: the top-level module, one captured-size input, and its batch size (or None)."""

    model: nn.Module
    inputs: ModuleInputs
    batch_size: Optional[int]


@dataclasses.dataclass
class Job:
    """One submodule on its way to the profilers; preprocessors return an altered copy.

    contexts: factories of context managers every profiler enters around each call (e.g. autocast).
    """

    path: str
    module: nn.Module
    inputs: ModuleInputs
    batch_size: Optional[int]
    contexts: list[Callable[[], ContextManager]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def context(self) -> ContextManager:
        stack = contextlib.ExitStack()
        for factory in self.contexts:
            stack.enter_context(factory())
        return stack

    def run(self) -> Any:
        with self.context():
            return self.inputs.call(self.module)


@dataclasses.dataclass
class RunContext:
    """Per-run facts every profiler may need; ``out_dir`` is None when artifacts are not wanted."""

    device: torch.device
    device_name: str
    compute_dtype: str
    peak: Optional[DevicePeak]
    warmup: int
    repeats: int
    timer: str
    out_dir: Optional[Path]


class Provider:
    """Integrates a training stack: returns the model (already on ``device``) and one input batch."""

    def get_component(self, device: torch.device) -> Component:
        raise NotImplementedError


class Preprocessor:
    """Augments a job before profiling (batch size, precision, ...)."""

    name = "preprocessor"

    def apply(self, job: Job, ctx: RunContext) -> Job:
        raise NotImplementedError


class Profiler:
    """Measures one job; returns metric columns (None = n/a). ``so_far`` holds earlier profilers' columns."""

    name = "profiler"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class ResultPlugin:
    """Runs after all submodules: turns the result tree into files; returns the paths written."""

    name = "result"

    def write(self, result: BenchResult, out_dir: Path) -> list[Path]:
        raise NotImplementedError


def make(registry: Mapping[str, type], key: str, field: str, **kwargs: Any) -> Any:
    """Instantiate ``registry[key](**kwargs)``; an unknown key is a one-line ValueError naming ``field``."""
    if key not in registry:
        raise ValueError(f"{field}={key!r} is unknown; valid values: {sorted(registry)}")
    return registry[key](**kwargs)
