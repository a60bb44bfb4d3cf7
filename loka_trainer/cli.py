"""Hydra at the edge: compose `conf/<name>.yaml` with command-line overrides, fail fast in one line, make the run dir.

We use Hydra's compose API rather than ``@hydra.main`` so that a bad override (unknown model, unknown key,
wrong type, failed validation) becomes one line on stderr and exit code 2, before any process group or data
exists, and so that every torchrun rank resolves the same run directory:

- ``hydra.run.dir=DIR`` wins;
- otherwise ``outputs/<date>/<time>`` for a single process, and ``outputs/torchrun-<run id>`` under torchrun
  (all ranks share TORCHELASTIC_RUN_ID; their clocks may differ by a second).
"""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Optional, TypeVar

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

# The configs ship inside the package; LOKA_CONF_DIR points at another tree of them (tests use a throwaway one).
CONF_DIR = Path(os.environ.get("LOKA_CONF_DIR", Path(__file__).resolve().parent / "conf"))
T = TypeVar("T")


def run_name() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun-{run_id[:8]}"
    return datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


if not OmegaConf.has_resolver("loka_run_name"):
    OmegaConf.register_new_resolver("loka_run_name", run_name, use_cache=True)


def fail(message: object) -> NoReturn:
    """One line on stderr, exit status 2 (Hydra's search-path listing is noise for a user)."""
    text = str(message)
    cause = getattr(message, "__cause__", None)
    if cause is not None and str(cause).splitlines():
        text += f" ({str(cause).splitlines()[0]})"
    text = text.split("Config search path")[0]
    print(f"error: {' '.join(text.split())}", file=sys.stderr)
    raise SystemExit(2)


def compose_config(config_name: str, argv: list[str]) -> tuple[DictConfig, Path]:
    """Compose `conf/<config_name>.yaml` + overrides; returns the config (without its `hydra` node) and run dir."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(argv), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        run_dir = Path(cfg.hydra.run.dir)
        with open_dict(cfg):
            del cfg["hydra"]
        OmegaConf.resolve(cfg)
    except Exception as exc:  # Hydra raises several types; all are a bad command line here
        fail(exc)
    return cfg, run_dir


def typed_config(cfg: DictConfig, convert: Callable[[DictConfig], T]) -> T:
    """Run `convert` (typed objects + validation); any ValueError/TypeError is a one-line failure."""
    try:
        return convert(cfg)
    except Exception as exc:  # ValueError from validation, OmegaConf errors from conversion
        fail(exc)


def write_run_config(run_dir: Path, cfg: DictConfig, argv: list[str], *, rank: int) -> None:
    """Rank 0 records what ran: `.hydra/config.yaml` and `.hydra/overrides.yaml` like Hydra does."""
    if rank != 0:
        return
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(argv)), hydra_dir / "overrides.yaml")


def parse_argv(argv: Optional[list[str]] = None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)
