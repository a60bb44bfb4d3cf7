"""The one function that parallelizes a model: TorchRec shards the embeddings, FSDP2 shards the dense part.

Contract with the model zoo: embeddings are TorchRec `EmbeddingBagCollection` / `EmbeddingCollection`
modules, and ``model.dense_units()`` lists submodules that together hold every other parameter; each one becomes
an FSDP2 unit. DMP's own data-parallel wrapper knows DDP, not FSDP2, so it is disabled
(``init_data_parallel=False``) and ``fully_shard`` is applied to the dense units here.

No table is replicated: TorchRec trains a data-parallel table's weight with the dense optimizer, and ours holds only
the dense units, so such a table would keep its initial weights. Under "auto" a table the planner would replicate is
sharded table-wise instead, every other table keeping the planner's choice (`without_data_parallel`); at GPU scale
the planner picks no data-parallel table in the first place.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from loka_trainer.sharding.config import EMBEDDING_SHARDING_TYPES, ShardingConfig
from loka_trainer.sharding.dist import DistInfo

COMM_TYPES = {"fp32": CommType.FP32, "fp16": CommType.FP16, "bf16": CommType.BF16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EMBEDDING_MODULE_TYPES = (EmbeddingBagCollection, EmbeddingCollection)


@dataclasses.dataclass
class ParallelModel:
    """What `parallelize` returns: the DMP-wrapped model and what the trainer reports at start-up."""

    model: DistributedModelParallel
    comm_precision: tuple[str, str]  # effective (forward, backward) all-to-all precision
    sharding_plan: str  # TorchRec's plan, printable
    table_sharding: dict[str, str]  # table name -> sharding type
    made_table_wise: list[str]  # tables the planner would have replicated (`without_data_parallel`)
    num_fsdp_units: int


def effective_comm_precision(requested: str, *, device_type: str) -> str:
    """The all-to-all precision TorchRec will really use: gloo (CPU) has no BF16, TorchRec falls back to FP16."""
    return "fp16" if (requested == "bf16" and device_type == "cpu") else requested


def embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, EMBEDDING_MODULE_TYPES)]


def check_dense_units_cover(model: nn.Module) -> None:
    """Every parameter outside the embedding modules must sit in exactly one dense unit (else FSDP2 misses it)."""
    embedding_params = {id(p) for _, m in embedding_modules(model) for p in m.parameters()}
    unit_params: dict[int, int] = {}
    for unit in model.dense_units():
        for p in unit.parameters():
            unit_params[id(p)] = unit_params.get(id(p), 0) + 1
    for name, p in model.named_parameters():
        if id(p) in embedding_params:
            continue
        count = unit_params.get(id(p), 0)
        if count != 1:
            raise ValueError(f"parameter {name} is in {count} dense units of {type(model).__name__}; "
                             f"dense_units() must cover every non-embedding parameter exactly once")


def parallelize(model: nn.Module, *, config: ShardingConfig, dist_info: DistInfo,
                embedding_lr: float) -> ParallelModel:
    """Shard `model` in place of the caller's copy. Embedding optimizer: fused row-wise Adagrad (in backward)."""
    check_dense_units_cover(model)
    for _, module in embedding_modules(model):
        apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": embedding_lr, "eps": 1e-8})
    sharders = _sharders(config, dist_info.device)
    topology = Topology(world_size=dist_info.world_size, compute_device=dist_info.device.type)
    plan = EmbeddingShardingPlanner(topology=topology, constraints=_constraints(model, config.embedding)
                                    ).collective_plan(model, sharders, dist.GroupMember.WORLD)
    made_table_wise = _data_parallel_tables(plan)
    pinned = without_data_parallel(plan)
    if pinned is not None:  # plan again with every table's sharding type fixed
        plan = EmbeddingShardingPlanner(topology=topology, constraints=pinned
                                        ).collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=dist_info.device, plan=plan, sharders=sharders,
                                   init_data_parallel=False)
    if config.fsdp:
        num_units = _fully_shard_dense(dmp.module, config, dist_info)
    else:  # one rank (checked by the config): the dense part stays whole, on the device
        num_units = _dense_to_device(dmp.module, dist_info.device)
    precision = tuple(effective_comm_precision(p, device_type=dist_info.device.type)
                      for p in (config.qcomm_forward, config.qcomm_backward))
    return ParallelModel(model=dmp, comm_precision=precision, sharding_plan=str(plan), num_fsdp_units=num_units,
                         table_sharding={name: ps.sharding_type for name, ps in _table_shardings(plan).items()},
                         made_table_wise=made_table_wise)


def _sharders(config: ShardingConfig, device: torch.device) -> list:
    qcomms = QCommsConfig(forward_precision=COMM_TYPES[config.qcomm_forward],
                          backward_precision=COMM_TYPES[config.qcomm_backward])
    registry = get_qcomm_codecs_registry(qcomms, device=device)
    return [EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry),
            EmbeddingCollectionSharder(qcomm_codecs_registry=registry)]


def embedding_sharding_types(device_type: str) -> list[str]:
    """The sharding types `sharding.embedding` may name on ``device_type``: those every sharder of ours offers
    there (TorchRec shards an `EmbeddingBagCollection` row-wise on GPUs only), data-parallel excepted."""
    offered = [set(sharder.sharding_types(device_type)) for sharder in (EmbeddingBagCollectionSharder(),
                                                                          EmbeddingCollectionSharder())]
    return [t for t in EMBEDDING_SHARDING_TYPES if t == "auto" or all(t in types for types in offered)]


def without_data_parallel(plan: ShardingPlan) -> Optional[dict[str, ParameterConstraints]]:
    """None when no table of ``plan`` is data-parallel; else constraints that keep every other table's sharding type
    and compute kernel and make each data-parallel one table-wise."""
    replicated = _data_parallel_tables(plan)
    if not replicated:
        return None
    return {name: (ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) if name in replicated
                   else ParameterConstraints(sharding_types=[ps.sharding_type], compute_kernels=[ps.compute_kernel]))
            for name, ps in _table_shardings(plan).items()}


def _table_shardings(plan: ShardingPlan) -> dict:
    return {name: ps for module_plan in plan.plan.values() for name, ps in module_plan.items()}


def _data_parallel_tables(plan: ShardingPlan) -> list[str]:
    return sorted(name for name, ps in _table_shardings(plan).items()
                  if ps.sharding_type == ShardingType.DATA_PARALLEL.value)


def _constraints(model: nn.Module, sharding_type: str) -> Optional[dict[str, ParameterConstraints]]:
    if sharding_type == "auto":
        return None
    tables = [cfg.name for _, m in embedding_modules(model) for cfg in _table_configs(m)]
    return {t: ParameterConstraints(sharding_types=[sharding_type]) for t in tables}


def _table_configs(module: nn.Module) -> list:
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bag_configs()
    return module.embedding_configs()


def _dense_to_device(model: nn.Module, device: torch.device) -> int:
    """Without FSDP2 nothing moves the dense units (DMP places only the embeddings): move them; 0 FSDP2 units."""
    for unit in model.dense_units():
        unit.to(device)
    return 0


def _fully_shard_dense(model: nn.Module, config: ShardingConfig, dist_info: DistInfo) -> int:
    mesh = init_device_mesh(dist_info.device.type, (dist_info.world_size,))
    param_dtype = TORCH_DTYPES[config.fsdp_param_dtype] if config.fsdp_param_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=TORCH_DTYPES[config.fsdp_reduce_dtype])
    units = model.dense_units()
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        # FSDP2 warns at each unit returning a view (OverArch's squeeze, DenseEmbeddingArch's unflatten): an
        # in-place op on it would skip the all-gather. The zoo models apply none to their units' outputs.
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=rf"FSDP2-wrapped module \({re.escape(type(unit).__name__)}\) returned a view")
    return len(units)
