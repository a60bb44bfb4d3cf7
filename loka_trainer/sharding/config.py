"""How a model is parallelized: TorchRec sharding for embeddings, FSDP2 for the dense part."""
from __future__ import annotations

import dataclasses
from typing import Optional

# No "data_parallel": TorchRec leaves a replicated table's weight to the dense optimizer, outside the fused
# row-wise Adagrad every other table trains with, so it would not train here (`sharding.parallelize`).
EMBEDDING_SHARDING_TYPES = ("auto", "table_wise", "column_wise", "row_wise")
COMM_PRECISIONS = ("fp32", "fp16", "bf16")
FSDP_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class ShardingConfig:
    """`embedding`: "auto" lets the TorchRec planner choose among its sharded types (never data-parallel); any
    other value constrains every table to it (row_wise: GPUs only, as TorchRec offers it; checked with the config).
    `qcomm_forward` / `qcomm_backward`: precision of the embedding all-to-all (TorchRec QCommsConfig).
    `fsdp_param_dtype` / `fsdp_reduce_dtype`: FSDP2 MixedPrecisionPolicy of the dense part.
    """

    name: str = "auto"
    embedding: str = "auto"
    qcomm_forward: str = "bf16"
    qcomm_backward: str = "bf16"
    fsdp: bool = True
    fsdp_param_dtype: Optional[str] = None
    fsdp_reduce_dtype: str = "bfloat16"

    def validate(self) -> None:
        _check_choice("sharding.embedding", self.embedding, EMBEDDING_SHARDING_TYPES)
        _check_choice("sharding.qcomm_forward", self.qcomm_forward, COMM_PRECISIONS)
        _check_choice("sharding.qcomm_backward", self.qcomm_backward, COMM_PRECISIONS)
        _check_choice("sharding.fsdp_reduce_dtype", self.fsdp_reduce_dtype, FSDP_DTYPES)
        if self.fsdp_param_dtype is not None:
            _check_choice("sharding.fsdp_param_dtype", self.fsdp_param_dtype, FSDP_DTYPES)


def dense_part_line(config: ShardingConfig, *, num_fsdp_units: int, num_dense_units: int, device: object) -> str:
    """train.log's line on the dense part: its FSDP2 units and their reduce dtype, or without FSDP2
    (``sharding.fsdp=false``, one rank) its units whole on ``device``, with no reduction and no FSDP2 dtypes."""
    if config.fsdp:
        param = f", parameter dtype {config.fsdp_param_dtype}" if config.fsdp_param_dtype is not None else ""
        return f"dense part: {num_fsdp_units} FSDP2 units, reduce dtype {config.fsdp_reduce_dtype}{param}"
    defaults = ShardingConfig()
    unread = [f"sharding.{field}" for field in ("fsdp_param_dtype", "fsdp_reduce_dtype")
              if getattr(config, field) != getattr(defaults, field)]
    return (f"dense part: {num_dense_units} units whole on {device} without FSDP2 (sharding.fsdp=false): parameters "
            f"in their own dtype, gradients not reduced (one rank)"
            + (f"; {', '.join(unread)} unread" if unread else ""))


def _check_choice(field: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(valid)}")


# TorchRec's planner cuts a column-wise table into blocks of the smallest multiple of 4 in [MIN_COLUMN_BLOCK, dim)
# that divides dim, else one block of dim (torchrec.distributed.sharding_plan._get_block_size_for_cw_shard with
# its MIN_CW_DIM; `parallelize` sets no min_partition). FBGEMM's embedding kernels need every shard's column count
# to be a multiple of COLUMN_MULTIPLE (TorchRec asserts it after the process group started).
MIN_COLUMN_BLOCK = 128
COLUMN_MULTIPLE = 4


def shard_columns(embedding_dim: int, sharding_type: str) -> list[int]:
    """The column counts of one table's shards under ``sharding_type`` (every shard holds all of a row's columns
    but under column_wise)."""
    if sharding_type != "column_wise":
        return [embedding_dim]
    block = next((width for width in range(MIN_COLUMN_BLOCK, embedding_dim)
                  if embedding_dim % width == 0 and width % COLUMN_MULTIPLE == 0), embedding_dim)
    return [block] * (embedding_dim // block)


def check_embedding_columns(embedding_dim: int) -> None:
    """``model.embedding_dim`` gives every table shard a column count FBGEMM's kernels take, under each sharding
    type (``sharding.embedding=auto`` lets the planner pick any of them)."""
    shards = {t: shard_columns(embedding_dim, t) for t in EMBEDDING_SHARDING_TYPES if t != "auto"}
    if any(c % COLUMN_MULTIPLE for columns in shards.values() for c in columns):
        described = ", ".join(f"{t} {columns}" for t, columns in shards.items())
        raise ValueError(f"model.embedding_dim={embedding_dim} must be a multiple of {COLUMN_MULTIPLE}: TorchRec's "
                         f"embedding kernels need the column count of each table shard to be one (shards: {described})")
