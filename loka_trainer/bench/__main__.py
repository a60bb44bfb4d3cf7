"""``python -m loka_trainer.bench model=wukong hydra.run.dir=DIR [bench.depth=4 bench.device=cuda ...]``, or a
module of yours: ``python -m loka_trainer.bench bench.provider=factory bench.factory=mypkg.models:build ...``.

Composes ``conf/bench.yaml`` (same ``model=`` / ``data=`` groups as the trainer), profiles every submodule
with a progress bar, and writes the table (CSV/JSON/Markdown) and the offline icicle HTML into DIR; an earlier
run's outputs there move to DIR/previous/<date>_<time>/ for the run, and back if it fails (`earlier_run_set_aside`).
Hydra's own flags work as for ``train.py`` (``--help``, ``--cfg job``, ``--config-dir``); every setting is checked
before anything is written or measured.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from loka_trainer.bench import BenchOptions, ExampleProvider, FactoryProvider, ZooProvider, run_bench, write_results
from loka_trainer.bench.plugins import Component, Provider
from loka_trainer.bench.results import earlier_run_set_aside, stderr_line
from loka_trainer.bench.runner import check_filters, check_timer, resolve_device

PROVIDER_KEYS = ("provider", "example", "factory", "loka_mods")
# Hydra flags that print something (usage, the config, a completion script) and start no benchmark
SHOW_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion")
HELP_NAME = "hydra.help.app_name=loka_trainer.bench"  # --help's first line names this module, not Hydra's caller


def register_schemas() -> None:
    """The trainer's structured configs (model / data groups), when the model zoo is installed."""
    try:
        from loka_trainer.config import register_schemas as register  # noqa: PLC0415 -- needs the model zoo
    except ImportError:
        return
    register()


def compose(args: argparse.Namespace) -> tuple[DictConfig, Path]:
    """The composed config and run dir of a parsed command line (``--config-dir`` / ``--config-name`` included)."""
    from loka_trainer.cli import compose_config  # noqa: PLC0415

    search = [f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]"] if args.config_dir else []
    cfg, run_dir, _ = compose_config(args.config_name or "bench", [*search, *args.overrides])
    return cfg, run_dir


def bench_options(cfg: DictConfig) -> BenchOptions:
    """The checked options of ``cfg.bench`` (every field, that ``bench.device`` exists here and that
    ``bench.timer`` can time on it); a ValueError names the field and its valid values."""
    bench = OmegaConf.to_container(cfg.bench, resolve=True)
    opts = BenchOptions.from_mapping({k: v for k, v in bench.items() if k not in PROVIDER_KEYS})
    check_timer(opts.timer, resolve_device(opts.device))
    return opts


def _typed(node: Any, cls: Optional[type] = None) -> Any:
    if not isinstance(node, DictConfig):
        return node
    obj = OmegaConf.to_object(node)
    return cls(**obj) if cls is not None and isinstance(obj, dict) else obj


def _example(cfg: DictConfig, bench: dict) -> tuple[Provider, str]:
    name = bench.get("example") or DEFAULT_EXAMPLE
    return ExampleProvider(name, batch_size=bench["batch_size"] or 8), name


def _factory(cfg: DictConfig, bench: dict) -> tuple[Provider, str]:
    if not bench.get("factory"):
        raise ValueError("bench.provider=factory needs bench.factory=package.module:function")
    provider = FactoryProvider(bench["factory"], batch_size=bench["batch_size"] or 8)
    return provider, provider.name


def _zoo(cfg: DictConfig, bench: dict) -> tuple[Provider, str]:
    from loka_trainer.data.config import DataConfig  # noqa: PLC0415

    model_cfg = _typed(cfg.model)
    name = getattr(model_cfg, "name", None) or (model_cfg.get("name") if isinstance(model_cfg, dict) else "model")
    return ZooProvider(model_cfg, _typed(cfg.data, DataConfig), batch_size=bench["batch_size"],
                       loka_mods=bench["loka_mods"]), str(name)


DEFAULT_EXAMPLE = "nanogpt"  # bench.provider=example without bench.example
# the bench settings only one provider reads: set under another, the run would measure another model than named
READ_BY_PROVIDER_ONLY = {"example": "example", "factory": "factory", "loka_mods": "zoo"}

# bench.provider -> (the composed config, the bench section) -> (provider, a short name for the output files)
PROVIDER_BUILDERS: dict[str, Callable[[DictConfig, dict], tuple[Provider, str]]] = {
    "zoo": _zoo, "example": _example, "factory": _factory}


def build_provider(cfg: DictConfig, bench: dict) -> tuple[Provider, str]:
    """The provider named by ``bench.provider`` and a short name for the output files."""
    kind = bench["provider"]
    if kind not in PROVIDER_BUILDERS:
        raise ValueError(f"bench.provider={kind!r} is unknown; valid values: {sorted(PROVIDER_BUILDERS)}")
    for key, reader in READ_BY_PROVIDER_ONLY.items():
        if bench.get(key) and kind != reader:
            raise ValueError(f"bench.{key}={bench[key]} is read only with bench.provider={reader}, not "
                             f"bench.provider={kind}; add bench.provider={reader}")
    return PROVIDER_BUILDERS[kind](cfg, bench)


def _shows_only(args: argparse.Namespace) -> bool:
    return any(getattr(args, flag) for flag in SHOW_FLAGS)


def with_help_name(argv: list[str], overrides: list[str]) -> list[str]:
    """``argv`` with ``HELP_NAME`` just before its overrides (first, without any): argparse takes Hydra's overrides
    as one run of positional arguments, so one appended after a flag would be an unrecognized argument
    (``model=wukong --help``) or the value of a flag whose value is optional (``--info``)."""
    n = len(overrides)
    at = next((i for i in range(len(argv) - n + 1) if n and argv[i:i + n] == overrides), 0)
    return [*argv[:at], HELP_NAME, *argv[at:]]


def _validate(cfg: DictConfig, choices: dict[str, str]) -> BenchOptions:
    """`bench_options` as the pre-flight's check (the group choices pick nothing a benchmark checks)."""
    return bench_options(cfg)


def _no_run(cfg: DictConfig, run_dir: Path, overrides: list[str], choices: dict[str, str]) -> None:
    """The job handed to Hydra for ``--help`` / ``--cfg`` / ``--info``: Hydra prints and never calls it."""


def prepare(args: argparse.Namespace) -> tuple[DictConfig, Path, BenchOptions, Component, str]:
    """The config, run dir, options, model with its input, and output name of a run, nothing written yet; a bad
    provider, device or include/exclude glob is one ``error:`` line and exit status 2."""
    from loka_trainer.cli import fail  # noqa: PLC0415

    cfg, run_dir = compose(args)
    bench = OmegaConf.to_container(cfg.bench, resolve=True)
    try:
        opts = bench_options(cfg)
        provider, name = build_provider(cfg, bench)
        component = provider.get_component(resolve_device(opts.device))
        check_filters(component.model, opts)
    except (ValueError, TypeError) as err:
        fail(err)
    return cfg, run_dir, opts, component, name


def main(argv: Optional[list[str]] = None) -> int:
    """Hydra's command line (``--help``, ``--cfg job``, ``--config-dir``...). Every setting, the provider, the
    device, the include/exclude globs and the run dir are checked before anything is written: a bad one is one
    ``error:`` line on stderr and exit status 2."""
    from loka_trainer.cli import (fail, parse_argv, parse_hydra_args, preflight, run_app,  # noqa: PLC0415
                                  write_run_config)

    argv = parse_argv(argv)
    register_schemas()
    _, args = parse_hydra_args(argv)
    if _shows_only(args):
        run_app("bench", with_help_name(argv, args.overrides), _no_run, validate=_validate)
        return 0
    if args.multirun:
        fail("-m/--multirun is not supported by the Component Benchmark: run one configuration per command")
    preflight("bench", args, _validate)
    cfg, run_dir, opts, component, name = prepare(args)
    with earlier_run_set_aside(run_dir, stderr_line):
        try:
            result = run_bench(component, opts, out_dir=run_dir)
        except ValueError as err:  # the model's forward failed: its own line, not its traceback
            fail(str(err))
        write_run_config(run_dir, cfg, argv, rank=0)
        paths = write_results(result, run_dir, opts.results, stem=f"bench_{name}",
                              title=f"Component Benchmark: {name}", color_by=opts.color_by)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
