"""Structured-config schemas (Hydra's ConfigStore) and their validation; the only module that knows Hydra's tree.

`conf/config.yaml` composes: ``model/`` (one schema per zoo entry), ``data/``, ``precision/``, ``sharding/``,
plus ``trainer`` and ``callbacks``. `register_schemas()` stores every schema; `to_run_config()` turns the composed
DictConfig into typed objects and validates them, raising a one-line `ValueError` for the first bad field.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from loka_trainer.callbacks.probe import ProbeConfig
from loka_trainer.data.config import DataConfig
from loka_trainer.models.configs import MODEL_CONFIGS
from loka_trainer.nonfinite import NONFINITE_POLICIES
from loka_trainer.precision import PrecisionConfig
from loka_trainer.sharding.config import ShardingConfig

# trainer.dense_optimizer -> the torch optimizer of the dense part (embeddings use TorchRec's fused optimizer)
DENSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
}
DEVICES = ("auto", "cpu", "cuda")


@dataclasses.dataclass
class TrainerConfig:
    """The loop. Intervals are in steps; 0 disables the periodic action (the end-of-run eval always runs)."""

    steps: int = 1000
    seed: int = 0
    device: str = "auto"
    dense_optimizer: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    embedding_lr: float = 0.05
    log_interval: int = 10
    eval_interval: int = 100
    checkpoint_interval: int = 0
    checkpoint_at_end: bool = True  # also save after the last step (a restart then only re-evaluates)
    checkpoint_dir: Optional[str] = None  # default: <run dir>/checkpoints
    resume: bool = True  # continue from the newest complete checkpoint in checkpoint_dir (rules: loka_trainer.resume)
    nonfinite: str = "error"  # non-finite loss/gradient: "error" stops naming the step, "skip_step" skips it
    stop_after: Optional[int] = None  # end the run early after this step (a checkpoint is saved there)
    compile: bool = False  # torch.compile each dense unit (after FSDP2); embeddings and the loop stay eager

    def validate(self) -> None:
        for field in ("steps", "log_interval"):
            if getattr(self, field) <= 0:
                raise ValueError(f"trainer.{field} must be > 0, got {getattr(self, field)}")
        for field in ("eval_interval", "checkpoint_interval"):
            if getattr(self, field) < 0:
                raise ValueError(f"trainer.{field} must be >= 0, got {getattr(self, field)}")
        if self.lr <= 0 or self.embedding_lr <= 0:
            raise ValueError(f"trainer.lr and trainer.embedding_lr must be > 0, got {self.lr}, {self.embedding_lr}")
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"trainer.dense_optimizer={self.dense_optimizer!r} is not one of "
                             f"{', '.join(DENSE_OPTIMIZERS)}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"trainer.nonfinite={self.nonfinite!r} is not one of {', '.join(NONFINITE_POLICIES)}")
        if self.device not in DEVICES:
            raise ValueError(f"trainer.device={self.device!r} is not one of {', '.join(DEVICES)}")
        if self.stop_after is not None and not 0 < self.stop_after <= self.steps:
            raise ValueError(f"trainer.stop_after must be in (0, trainer.steps], got {self.stop_after}")


@dataclasses.dataclass
class ProfilerConfig:
    """torch.profiler trace of steps [start_step, start_step + num_steps), readable by TensorBoard."""

    enabled: bool = False
    start_step: int = 5
    num_steps: int = 3

    def validate(self) -> None:
        if self.start_step < 0 or self.num_steps <= 0:
            raise ValueError(f"callbacks.profiler needs start_step >= 0 and num_steps > 0, "
                             f"got {self.start_step}, {self.num_steps}")


@dataclasses.dataclass
class CallbacksConfig:
    tensorboard: bool = True
    progress: bool = True
    profiler: ProfilerConfig = dataclasses.field(default_factory=ProfilerConfig)
    probe: ProbeConfig = dataclasses.field(default_factory=ProbeConfig)


@dataclasses.dataclass
class TrainConfig:
    model: Any = MISSING
    data: DataConfig = MISSING
    precision: PrecisionConfig = MISSING
    sharding: ShardingConfig = MISSING
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    callbacks: CallbacksConfig = dataclasses.field(default_factory=CallbacksConfig)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The typed, validated run configuration the trainer receives."""

    model: Any
    data: DataConfig
    precision: PrecisionConfig
    sharding: ShardingConfig
    trainer: TrainerConfig
    callbacks: CallbacksConfig


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="precision", name="precision_schema", node=PrecisionConfig)
    cs.store(group="sharding", name="sharding_schema", node=ShardingConfig)
    for name, config_cls in MODEL_CONFIGS.items():
        cs.store(group="model", name=f"{name}_schema", node=config_cls)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed objects from the composed config, each validated (one-line `ValueError` on the first bad field)."""
    parts = {key: OmegaConf.to_object(cfg[key]) for key in ("model", "data", "precision", "sharding",
                                                          "trainer", "callbacks")}
    run = RunConfig(**parts)
    for part in (run.data, run.precision, run.sharding, run.trainer, run.callbacks.profiler):
        part.validate()
    if hasattr(run.model, "validate"):
        run.model.validate()
    if hasattr(run.callbacks.probe, "validate"):
        run.callbacks.probe.validate()
    return run


def config_summary(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


__all__: List[str] = ["TrainConfig", "RunConfig", "TrainerConfig", "CallbacksConfig", "ProfilerConfig",
                      "register_schemas", "to_run_config"]
