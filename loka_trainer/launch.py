"""`train.py`'s body: compose + validate the config (no process group yet), then start ranks and train.

    python train.py model=wukong precision=loka trainer.steps=300 hydra.run.dir=DIR
    torchrun --nproc_per_node=2 train.py model=wukong ...
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from loka_trainer.cli import parse_argv, run_app, typed_config, write_run_config
from loka_trainer.config import register_schemas, to_run_config
from loka_trainer.sharding.dist import init_distributed, launch_env, shutdown_distributed


def setup_logging(run_dir: Path, *, rank: int) -> None:
    """Rank 0 logs our INFO lines to stdout and `run_dir/train.log`; libraries and other ranks only warnings."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if rank == 0:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(level=logging.WARNING, handlers=handlers, force=True,
                        format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("loka_trainer").setLevel(logging.INFO if rank == 0 else logging.WARNING)


def main(argv: Optional[list[str]] = None) -> None:
    """Hydra's command line (``--help``, ``--cfg job``, ``-m``...); every run is checked before the first starts."""
    register_schemas()
    run_app("config", parse_argv(argv), train_run, validate=to_run_config)


def train_run(cfg: DictConfig, run_dir: Path, argv: list[str]) -> None:
    """One run: ``cfg`` composed and resolved, ``argv`` its overrides (one sweep point's under ``-m``)."""
    run = typed_config(cfg, to_run_config)  # every bad input fails here, before any process group or data
    rank = launch_env()[0]
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, rank=rank)
    write_run_config(run_dir, cfg, argv, rank=rank)
    dist_info = init_distributed(run.trainer.device)
    log = logging.getLogger("loka_trainer").info
    finished = False
    try:
        from loka_trainer.trainer import Trainer

        log(f"run dir: {run_dir.resolve()}  (world size {dist_info.world_size}, device {dist_info.device})")
        Trainer(run, run_dir=run_dir, dist_info=dist_info).fit()
        log(f"done: metrics {run_dir.resolve() / 'metrics.jsonl'}, summary {run_dir.resolve() / 'summary.json'}, "
            f"TensorBoard: tensorboard --logdir {run_dir.resolve() / 'tensorboard'}")
        finished = True
    finally:
        shutdown_distributed(wait_for_all=finished)  # after an error another rank may never reach a barrier
