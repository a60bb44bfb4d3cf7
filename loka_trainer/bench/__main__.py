"""``python -m loka_trainer.bench model=wukong hydra.run.dir=DIR [bench.depth=4 bench.device=cuda ...]``, or a
module of yours: ``python -m loka_trainer.bench bench.provider=factory bench.factory=mypkg.models:build ...``.

Composes ``conf/bench.yaml`` (same ``model=`` / ``data=`` groups as the trainer), profiles every submodule
with a progress bar, and writes the table (CSV/JSON/Markdown) and the offline icicle HTML into DIR.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from loka_trainer.bench import BenchOptions, ExampleProvider, FactoryProvider, ZooProvider, run_bench, write_results
from loka_trainer.bench.plugins import Provider
from loka_trainer.bench.runner import resolve_device
from loka_trainer.output_dirs import unwritable_reason

PROVIDER_KEYS = ("provider", "example", "factory", "loka_mods")


def compose(argv: list[str]) -> tuple[DictConfig, Path]:
    """The one place that knows how configs are composed (the trainer's CLI; schemas registered first)."""
    from loka_trainer.cli import compose_config  # noqa: PLC0415

    try:
        from loka_trainer.config import register_schemas  # noqa: PLC0415 -- needs the model zoo
    except ImportError:
        register_schemas = None
    if register_schemas is not None:
        register_schemas()
    return compose_config("bench", argv)


def _typed(node: Any, cls: Optional[type] = None) -> Any:
    if not isinstance(node, DictConfig):
        return node
    obj = OmegaConf.to_object(node)
    return cls(**obj) if cls is not None and isinstance(obj, dict) else obj


def _example(cfg: DictConfig, bench: dict) -> tuple[Provider, str]:
    return ExampleProvider(bench["example"], batch_size=bench["batch_size"] or 8), bench["example"]


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


# bench.provider -> (the composed config, the bench section) -> (provider, a short name for the output files)
PROVIDER_BUILDERS: dict[str, Callable[[DictConfig, dict], tuple[Provider, str]]] = {
    "zoo": _zoo, "example": _example, "factory": _factory}


def build_provider(cfg: DictConfig, bench: dict) -> tuple[Provider, str]:
    """The provider named by ``bench.provider`` and a short name for the output files."""
    kind = bench["provider"]
    if kind not in PROVIDER_BUILDERS:
        raise ValueError(f"bench.provider={kind!r} is unknown; valid values: {sorted(PROVIDER_BUILDERS)}")
    return PROVIDER_BUILDERS[kind](cfg, bench)


def main(argv: Optional[list[str]] = None) -> int:
    from loka_trainer.cli import fail, parse_argv, write_run_config  # noqa: PLC0415

    argv = parse_argv(argv)
    cfg, run_dir = compose(argv)
    bench = OmegaConf.to_container(cfg.bench, resolve=True)
    try:
        provider, name = build_provider(cfg, bench)
        opts = BenchOptions.from_mapping({k: v for k, v in bench.items() if k not in PROVIDER_KEYS})
    except (ValueError, TypeError) as err:
        fail(err)
    if (reason := unwritable_reason(run_dir)) is not None:
        fail(f"hydra.run.dir: cannot write to {run_dir} ({reason})")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(run_dir, cfg, argv, rank=0)
    component = provider.get_component(resolve_device(opts.device))
    result = run_bench(component, opts, out_dir=run_dir)
    paths = write_results(result, run_dir, opts.results, stem=f"bench_{name}",
                          title=f"Component Benchmark: {name}", color_by=opts.color_by)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
