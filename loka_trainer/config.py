"""Structured-config schemas (Hydra's ConfigStore) and their validation; the only module that knows Hydra's tree.

`conf/config.yaml` composes: ``model/`` (one schema per zoo entry), ``data/``, ``precision/``, ``sharding/``,
plus ``trainer`` and ``callbacks``. `register_schemas()` stores every schema; `to_run_config()` turns the composed
DictConfig into typed objects and validates them, raising a one-line `ValueError` for the first bad field.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Mapping, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from loka_trainer.callbacks.probe_config import ProbeConfig
from loka_trainer.data.config import DataConfig
from loka_trainer.dispatch.plan import DispatchPlan, load_plan, validate_plan, without_excluded
from loka_trainer.dispatch.targets import configured_targets, dispatch_exclude
from loka_trainer.globs import closest
from loka_trainer.kernels.backends import available_backends
from loka_trainer.models.configs import MODEL_CONFIGS
from loka_trainer.models.mods import LOKA_MODS, resolve_mods
from loka_trainer.mods.modes import FORWARD_MODES
from loka_trainer.nonfinite import NONFINITE_POLICIES
from loka_trainer.precision import PrecisionConfig
from loka_trainer.run_checks import (available_host_memory, check_data_has_the_model_sequences, check_host_memory,
                                     check_model_name, check_preset_names, check_profiler_window, chosen_presets,
                                     local_ranks)
from loka_trainer.sharding.config import ShardingConfig
from loka_trainer.sharding.dist import launch_env, resolve_device

# trainer.dense_optimizer -> the torch optimizer of the dense part (embeddings use TorchRec's fused optimizer). Adam
# and AdamW run torch's fused implementation (one kernel over every shard per step, DTensor shards included) rather
# than the default foreach one (an H200 wukong_h200 step spent 9.5 ms in multi-tensor kernels, these and the
# non-finite gradient check's)
DENSE_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": functools.partial(torch.optim.Adam, fused=True),
    "adamw": functools.partial(torch.optim.AdamW, fused=True),
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
}
DEVICES = ("auto", "cpu", "cuda")
SEED_RANGE = (-2**63, 2**64)  # what torch.manual_seed takes: [low, high)


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
    warmup_steps: int = 0  # dense lr rises linearly over the first N steps (loka_trainer.dense_update); 0: none
    grad_clip_norm: float = 0.0  # clip the dense gradient's total 2-norm to this (inf: only log it); 0: off
    log_interval: int = 10
    eval_interval: int = 100
    checkpoint_interval: int = 0
    checkpoint_at_end: bool = True  # also save after the last step (a restart then has nothing to do)
    checkpoint_dir: Optional[str] = None  # default: <run dir>/checkpoints
    resume: bool = True  # continue from the newest complete checkpoint in checkpoint_dir (rules: loka_trainer.resume)
    nonfinite: str = "error"  # non-finite loss/gradient: "error" stops naming the step, "skip_step" skips it
    stop_after: Optional[int] = None  # end the run early after this step (a checkpoint is saved there)
    compile: bool = False  # torch.compile each dense unit (after FSDP2); embeddings and the loop stay eager
    # SIGTERM / SIGUSR1 / Ctrl-C: save at the next log step and exit 128 + signal (loka_trainer.stop_signal)
    stop_on_signal: bool = True

    def validate(self) -> None:
        for field in ("steps", "log_interval"):
            if getattr(self, field) <= 0:
                raise ValueError(f"trainer.{field} must be > 0, got {getattr(self, field)}")
        for field in ("eval_interval", "checkpoint_interval", "warmup_steps"):
            if getattr(self, field) < 0:
                raise ValueError(f"trainer.{field} must be >= 0, got {getattr(self, field)}")
        inf = float("inf")
        # every float field -> (holds, what it must be); written so that NaN, failing every comparison, fails each
        number_rules = {
            "lr": (lambda v: 0 < v < inf, "a finite number > 0"),
            "embedding_lr": (lambda v: 0 < v < inf, "a finite number > 0"),
            "weight_decay": (lambda v: 0 <= v < inf, "a finite number >= 0"),
            "grad_clip_norm": (lambda v: v >= 0, "a number >= 0 (0: no clipping, inf: only log the norm)"),
        }
        for field, (holds, what) in number_rules.items():
            if not holds(getattr(self, field)):
                raise ValueError(f"trainer.{field} must be {what}, got {getattr(self, field)}")
        if self.dense_optimizer not in DENSE_OPTIMIZERS:
            raise ValueError(f"trainer.dense_optimizer={self.dense_optimizer!r} is not one of "
                             f"{', '.join(DENSE_OPTIMIZERS)}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"trainer.nonfinite={self.nonfinite!r} is not one of {', '.join(NONFINITE_POLICIES)}")
        if self.device not in DEVICES:
            raise ValueError(f"trainer.device={self.device!r} is not one of {', '.join(DEVICES)}")
        if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:  # torch.manual_seed overflows once the model is built
            raise ValueError(f"trainer.seed must be in [-2**63, 2**64) (torch.manual_seed's range), got {self.seed}")
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
    """Store every schema at the root of Hydra's config tree (``conf/<group>/*.yaml`` extend them with
    ``- /<name>_schema@_here_``), so that no group lists a schema as an option: ``model=dlrm_schema`` is unknown,
    and neither ``--help`` nor an error message offers it."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="data_schema", node=DataConfig)
    cs.store(name="precision_schema", node=PrecisionConfig)
    cs.store(name="sharding_schema", node=ShardingConfig)
    for name, config_cls in MODEL_CONFIGS.items():
        cs.store(name=f"{name}_schema", node=config_cls)


def check_known_keys(node: Any, path: str = "") -> None:
    """Reject a key that the node's schema dataclass does not declare, anywhere in the tree.

    Hydra's ``+key=value`` adds a key even to a structured node (past struct mode) and ``OmegaConf.to_object``
    then drops it silently; a typo must fail instead.
    """
    if isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
        for i, item in enumerate(node):
            check_known_keys(item, f"{path}[{i}]")
        return
    if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
        return
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        fields = [f.name for f in dataclasses.fields(schema)]
        for key in node.keys():
            if key not in fields:
                raise ValueError(f"unknown key {path}{key}: {schema.__name__} has no field {key!r} "
                                 f"(fields: {', '.join(fields)})")
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            check_known_keys(child, f"{path}{key}.")


def check_model_mods(model: Any) -> None:
    """``model.mods``'s switches and BlockNorm block size, as the model builder resolves them (a pure check)."""
    if getattr(model, "mods", None) is not None:
        resolve_mods(model.mods, published=LOKA_MODS, loka_mods=True)


def check_plan_file(run: RunConfig, model: Any) -> None:
    """``precision.plan``: readable JSON of the plan's layout (checked first, cheaply), whose layers and shapes
    are the Dispatch targets of ``model`` (`build_small_model`) and whose backends run on this rank's device."""
    if run.precision.plan is None or not run.precision.dispatch:
        return
    check_plan_against_model(load_plan(run.precision.plan), run, model)


def check_exclude_globs(run: RunConfig, model: Any) -> None:
    """``precision.exclude`` without a plan (``check_plan_file`` checks it with one): each glob names an FP8 target
    of ``model`` (`build_small_model`)."""
    p = run.precision
    if p.exclude and p.plan is None and (p.dispatch or p.fp8_recipe is not None):
        configured_targets(model, p)


def check_probe_targets(run: RunConfig, model: Any) -> None:
    """``callbacks.probe``'s filters select at least one layer of ``model`` (`build_small_model`): else the Probe
    would observe nothing and write no statistics, silently."""
    probe = run.callbacks.probe
    if not probe.enabled:
        return
    from loka_trainer.module_names import canonical_named_modules  # noqa: PLC0415 -- lazy
    from loka_trainer.probe.targets import LINEAR_TYPES, select_linears  # noqa: PLC0415 -- lazy

    if not select_linears(model, include=probe.include, exclude=probe.exclude, module_types=probe.module_types,
                          min_features=probe.min_features):
        names = [f for f, m in canonical_named_modules(model) if isinstance(m, LINEAR_TYPES)]
        near = closest([*(probe.include or ()), *(probe.module_types or ())], names)
        raise ValueError(f"callbacks.probe: include={probe.include}, exclude={probe.exclude}, module_types="
                         f"{probe.module_types}, min_features={probe.min_features} select none of the model's "
                         f"{len(names)} Linears" + (f"; closest: {near}" if near else f", e.g. {names[:3]}"))


def check_backends(run: RunConfig, device: torch.device) -> None:
    """``precision.backends`` that Dispatch will measure with all run on this rank's ``device``."""
    if run.precision.dispatch and run.precision.backends is not None and run.precision.plan is None:
        from loka_trainer.dispatch.build import candidate_backends  # noqa: PLC0415 -- lazy: the timers

        candidate_backends(run.precision, device)


def check_probe_stats(run: RunConfig, model: Any) -> None:
    """``precision.probe_stats`` (a report Dispatch will measure with) fits ``model`` (`build_small_model`), checked
    as Dispatch checks it (`dispatch.build.probe_mere_for`), before anything starts."""
    p = run.precision
    if p.probe_stats is None or p.plan is not None or not p.dispatch:
        return
    from loka_trainer.dispatch.build import probe_mere_for  # noqa: PLC0415 -- lazy: the kernels

    probe_mere_for(configured_targets(model, p, dispatch=True), p)


def check_plan_against_model(plan: DispatchPlan, run: RunConfig, model: Any) -> None:
    """``plan`` minus ``precision.exclude``'s layers against ``model`` (`build_small_model`): the target Linears'
    shapes depend on the model's widths and feature counts, not on the tables' row counts."""
    device = resolve_device(run.trainer.device, local_rank=launch_env()[2])
    linears = configured_targets(model, run.precision, dispatch=True)
    plan = without_excluded(plan, dispatch_exclude(model, run.precision))
    validate_plan(plan, {fqn: (m.in_features, m.out_features) for fqn, m in linears.items()},
                  list(available_backends(device)), mods_modes={mode: spec.fp8 for mode, spec in FORWARD_MODES.items()},
                  source=f"precision.plan {run.precision.plan!r}")


def build_small_model(run: RunConfig) -> Any:
    """The run's model for checks before training: 16-row embedding tables, every other parameter on the meta
    device (shapes without memory or initialisation: wukong_h200's dense part took seconds to initialise on a CPU,
    on every rank). Building it runs the model's own checks of its config (a ValueError naming the field)."""
    from loka_trainer.data import data_schema  # lazy: TorchRec
    from loka_trainer.models.zoo import build_model

    small = dataclasses.replace(run.data, max_vocab_size=min(run.data.max_vocab_size, 16),
                                sequence_vocab_size=min(run.data.sequence_vocab_size, 16))
    schema = data_schema(small)
    with torch.device("meta"):
        return build_model(run.model, schema=schema, loka_mods=run.precision.mods)


def to_run_config(cfg: DictConfig, choices: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """Typed objects from the composed config, each validated (one-line `ValueError` on the first bad field).

    ``choices``: Hydra's ``hydra.runtime.choices`` of the composition that gave ``cfg`` (group -> option, e.g.
    ``cli.compose_config(...).choices``): ``precision.name`` and ``sharding.name`` must stay their chosen preset's;
    None checks no name against a preset.

    Also checks what can be checked without a process group or data: unknown keys, the model's Mods, a plan
    file and ``precision.exclude`` against the model, that the Criteo eval slice holds a batch on every rank, and
    that the ids generated at once (and a CPU run's tables) fit in host memory.
    """
    check_known_keys(cfg)
    parts = {key: OmegaConf.to_object(cfg[key]) for key in ("model", "data", "precision", "sharding",
                                                          "trainer", "callbacks")}
    run = RunConfig(**parts)
    for part in (run.data, run.precision, run.sharding, run.trainer, run.callbacks.profiler):
        part.validate()
    check_model_name(run.model)
    check_preset_names(run, chosen_presets(choices or {}))
    if hasattr(run.model, "validate"):
        run.model.validate()
    if hasattr(run.callbacks.probe, "validate"):
        run.callbacks.probe.validate()
    check_model_mods(run.model)
    check_data_has_the_model_sequences(run)
    check_profiler_window(run)
    if run.data.name == "criteo":  # read a little of the files: each rank's share must make a batch
        from loka_trainer.data.criteo import check_shards  # noqa: PLC0415 -- lazy: imports torch

        check_shards(run.data, world_size=launch_env()[1])
    check_single_rank_without_fsdp(run.sharding, world_size=launch_env()[1])
    device = resolve_device(run.trainer.device, local_rank=launch_env()[2])  # trainer.device=cuda needs a GPU
    check_embedding_sharding(run, device.type)
    check_host_memory(run, device_type=device.type, local_ranks=local_ranks(), available=available_host_memory())
    model = build_small_model(run)  # the model's own config checks, and the shapes for the three below
    check_plan_file(run, model)
    check_exclude_globs(run, model)
    check_probe_stats(run, model)
    check_backends(run, device)
    check_probe_targets(run, model)
    return run


def check_single_rank_without_fsdp(sharding: ShardingConfig, *, world_size: int) -> None:
    """``sharding.fsdp=false`` keeps the dense part whole on each rank with nothing averaging its gradients, so
    it is for one rank only (e.g. to see what FSDP2 costs on one GPU)."""
    if not sharding.fsdp and world_size > 1:
        raise ValueError(f"sharding.fsdp=false needs one rank (world size {world_size}): nothing would average the "
                         f"dense gradients across ranks")


def check_embedding_sharding(run: RunConfig, device_type: str) -> None:
    """``sharding.embedding`` names a sharding type that TorchRec offers for the run's device (the planner would
    fail after the process group started)."""
    if run.sharding.embedding == "auto":
        return
    from loka_trainer.sharding.parallelize import embedding_sharding_types  # noqa: PLC0415 -- lazy: TorchRec

    offered = embedding_sharding_types(device_type)
    if run.sharding.embedding not in offered:
        raise ValueError(f"sharding.embedding={run.sharding.embedding} is not offered by TorchRec for embedding "
                         f"tables on {device_type} (there: {', '.join(offered)}); row_wise needs trainer.device=cuda")


def config_summary(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


__all__: List[str] = ["TrainConfig", "RunConfig", "TrainerConfig", "CallbacksConfig", "ProfilerConfig",
                      "register_schemas", "to_run_config"]
