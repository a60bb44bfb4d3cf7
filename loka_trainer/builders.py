"""The `build_*` steps that turn a validated RunConfig into the trainer's parts, in the order they run.

    streams -> model (zoo) -> model transforms (precision: FP8 / LoKA Dispatch) -> parallelize (TorchRec + FSDP2)
            -> dense optimizer -> callbacks
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from loka_trainer.callbacks.base import Callback
from loka_trainer.callbacks.logging import MetricsLogger, ProgressBar, TensorBoardLogger
from loka_trainer.callbacks.probe import ProbeCallback
from loka_trainer.callbacks.profiler import ProfilerCallback
from loka_trainer.config import DENSE_OPTIMIZERS, RunConfig
from loka_trainer.data import build_stream, data_schema
from loka_trainer.data.batch import Batch
from loka_trainer.dispatch.compile import reserve_compile_cache
from loka_trainer.kernels.linear import register_weight_cache_hook, weight_caches
from loka_trainer.models.summary import count_parameters, dense_flops_per_example
from loka_trainer.models.zoo import build_model
from loka_trainer.precision import apply_precision
from loka_trainer.sharding.config import dense_part_line
from loka_trainer.sharding.dist import DistInfo
from loka_trainer.sharding.parallelize import ParallelModel, parallelize

@dataclasses.dataclass
class Streams:
    train: object
    eval: object


def build_streams(run: RunConfig, dist_info: DistInfo) -> Streams:
    kwargs = dict(rank=dist_info.rank, world_size=dist_info.world_size)
    return Streams(train=build_stream(run.data, split="train", **kwargs),
                   eval=build_stream(run.data, split="eval", **kwargs))


def build_parallel_model(run: RunConfig, dist_info: DistInfo, *, sample_batch: Batch, run_dir: Path,
                         log: Callable[[str], None]) -> ParallelModel:
    """Zoo model -> start-up summary -> precision transform (same on every rank) -> TorchRec + FSDP2."""
    model = build_model(run.model, schema=data_schema(run.data), loka_mods=run.precision.mods)
    params = count_parameters(model)
    flops = dense_flops_per_example(model, sample_batch)
    log(f"model {run.model.name}: {params['dense']:,} dense + {params['sparse']:,} sparse parameters, "
        f"{flops / 1e6:.2f} MFLOP dense forward per example")
    # Collective under Dispatch: rank 0 measures the plan and broadcasts it, so every rank shards the same model.
    apply_precision(model, config=run.precision, device=dist_info.device, calibration_batch=sample_batch,
                    run_dir=run_dir, compile=run.trainer.compile, log=log)
    parallel = parallelize(model, config=run.sharding, dist_info=dist_info, embedding_lr=run.trainer.embedding_lr)
    if parallel.made_table_wise:
        tables = parallel.made_table_wise
        log(f"TorchRec's planner replicated {len(tables)} table(s) ({', '.join(tables)}); they are sharded "
            "table-wise instead: a replicated table would not train here")
    kinds = Counter(parallel.table_sharding.values())
    log(f"embedding tables: {', '.join(f'{n} {kind}' for kind, n in sorted(kinds.items()))}")
    fwd, bwd = parallel.comm_precision
    if (fwd, bwd) != (run.sharding.qcomm_forward, run.sharding.qcomm_backward):
        log(f"embedding all-to-all: requested {run.sharding.qcomm_forward}/{run.sharding.qcomm_backward}, "
            f"{dist_info.backend} supports no BF16 collectives, so TorchRec falls back to {fwd}/{bwd}")
    else:
        log(f"embedding all-to-all precision forward/backward: {fwd}/{bwd}")
    log(dense_part_line(run.sharding, num_fsdp_units=parallel.num_fsdp_units,
                        num_dense_units=len(parallel.model.module.dense_units()), device=dist_info.device))
    if run.trainer.compile:
        units = parallel.model.module.dense_units()
        reserve_compile_cache(parallel.model, log)  # one compiled graph per distinct LoKA layer plan
        for unit in units:  # compile after fully_shard: FSDP2's hooks stay outside the compiled graphs
            unit.compile()
        log(f"trainer.compile: {len(units)} dense units compiled with torch.compile")
    return parallel


def build_dense_optimizer(model: nn.Module, run: RunConfig) -> torch.optim.Optimizer:
    """Optimizer over the dense units' parameters (FSDP2 DTensor shards); embeddings use their fused optimizer. Its
    steps clear the LoKA layers' cached FP8 weights (``register_weight_cache_hook``)."""
    params = [p for unit in model.dense_units() for p in unit.parameters()]
    kwargs = {"lr": run.trainer.lr}
    if run.trainer.weight_decay:
        kwargs["weight_decay"] = run.trainer.weight_decay
    optimizer = DENSE_OPTIMIZERS[run.trainer.dense_optimizer](params, **kwargs)
    if weight_caches(model):  # LoKA layers only
        register_weight_cache_hook(model, optimizer)
    return optimizer


def build_callbacks(run: RunConfig, run_dir: Path, *, extra: Optional[list[Callback]] = None) -> list[Callback]:
    cbs = run.callbacks
    callbacks: list[Callback] = [MetricsLogger(run_dir, run_info={"model": run.model.name,
                                                                 "precision": run.precision.name})]
    if cbs.tensorboard:
        callbacks.append(TensorBoardLogger(run_dir / "tensorboard"))
    if cbs.progress:
        callbacks.append(ProgressBar())
    if cbs.profiler.enabled:
        callbacks.append(ProfilerCallback(run_dir / "tensorboard" / "profiler", summary_path=run_dir / "profile.json",
                                          start_step=cbs.profiler.start_step, num_steps=cbs.profiler.num_steps))
    if cbs.probe.enabled:
        callbacks.append(ProbeCallback.from_config(cbs.probe, run_dir=run_dir))
    return callbacks + list(extra or [])
