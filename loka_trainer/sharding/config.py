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


def _check_choice(field: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(valid)}")
