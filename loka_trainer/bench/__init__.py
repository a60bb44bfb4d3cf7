"""Component Benchmark: profile any ``nn.Module`` submodule by submodule (paper: Component Benchmark).

    from loka_trainer.bench import BenchOptions, ModuleProvider, run_bench, write_results
    result = run_bench(ModuleProvider(model, x).get_component(device), BenchOptions(depth=2))
    write_results(result, out_dir, BenchOptions().results)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

from loka_trainer.bench.options import BenchOptions
from loka_trainer.bench.plugins import Component, Job, Preprocessor, Profiler, Provider, ResultPlugin, RunContext, make
from loka_trainer.bench.preprocessors import PREPROCESSORS
from loka_trainer.bench.profilers import PROFILERS
from loka_trainer.bench.providers import PROVIDERS, ExampleProvider, FactoryProvider, ModuleProvider, ZooProvider
from loka_trainer.bench.results import RESULTS
from loka_trainer.bench.runner import run_bench
from loka_trainer.bench.tree import BenchResult, ModuleInputs, Node
from loka_trainer.output_dirs import unwritable_reason


def result_plugins(names: Sequence[str], **kwargs) -> list[ResultPlugin]:
    """The result plugins named in ``names`` (keys of ``RESULTS``), all checked before any runs; a plain string
    instead of a list, or an unknown name, is a ValueError."""
    if isinstance(names, str):
        raise ValueError(f"write_results: names must be a list of result names, e.g. [{names!r}], "
                         f"not the string {names!r}")
    return [make(RESULTS, name, "bench.results", **kwargs) for name in names]


def write_results(result: BenchResult, out_dir: Union[str, os.PathLike], names: Sequence[str],
                  **kwargs) -> list[Path]:
    """Run the result plugins named in ``names`` (keys of ``RESULTS``) into ``out_dir`` (a str or path, created if
    missing); kwargs go to each plugin's constructor. Bad names or an out_dir that cannot be written are one
    ValueError before any file is written."""
    plugins = result_plugins(names, **kwargs)
    out = Path(out_dir)
    if (reason := unwritable_reason(out)) is not None:
        raise ValueError(f"write_results: cannot write to {out} ({reason})")
    out.mkdir(parents=True, exist_ok=True)
    return [path for plugin in plugins for path in plugin.write(result, out)]


__all__ = [
    "BenchOptions", "BenchResult", "Component", "ExampleProvider", "FactoryProvider", "Job", "ModuleInputs",
    "ModuleProvider", "Node", "PREPROCESSORS", "PROFILERS", "PROVIDERS", "Preprocessor", "Profiler", "Provider",
    "RESULTS", "ResultPlugin", "RunContext", "ZooProvider", "run_bench", "write_results",
]
