"""Component Benchmark: profile any ``nn.Module`` submodule by submodule (paper: Component Benchmark).

    from loka_trainer.bench import BenchOptions, ModuleProvider, run_bench, write_results
    result = run_bench(ModuleProvider(model, x).get_component(device), BenchOptions(depth=2))
    write_results(result, out_dir, BenchOptions().results)
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from loka_trainer.bench.options import BenchOptions
from loka_trainer.bench.plugins import Component, Job, Preprocessor, Profiler, Provider, ResultPlugin, RunContext, make
from loka_trainer.bench.preprocessors import PREPROCESSORS
from loka_trainer.bench.profilers import PROFILERS
from loka_trainer.bench.providers import PROVIDERS, ExampleProvider, FactoryProvider, ModuleProvider, ZooProvider
from loka_trainer.bench.results import RESULTS
from loka_trainer.bench.runner import run_bench
from loka_trainer.bench.tree import BenchResult, ModuleInputs, Node


def write_results(result: BenchResult, out_dir: Path, names: Sequence[str], **kwargs) -> list[Path]:
    """Run the result plugins named in ``names`` (keys of ``RESULTS``); kwargs go to each plugin's constructor."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name in names:
        written += make(RESULTS, name, "bench.results", **kwargs).write(result, out_dir)
    return written


__all__ = [
    "BenchOptions", "BenchResult", "Component", "ExampleProvider", "FactoryProvider", "Job", "ModuleInputs",
    "ModuleProvider", "Node", "PREPROCESSORS", "PROFILERS", "PROVIDERS", "Preprocessor", "Profiler", "Provider",
    "RESULTS", "ResultPlugin", "RunContext", "ZooProvider", "run_bench", "write_results",
]
