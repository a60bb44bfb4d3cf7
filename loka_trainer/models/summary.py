"""Model size and cost summaries the trainer prints at start-up."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from loka_trainer.data.batch import Batch

# NOTE: sharded replacements (ShardedEmbeddingBagCollection, ...) are not subclasses of these; count
# before DistributedModelParallel wraps the model.
_EMBEDDING_TYPES = (EmbeddingBagCollection, EmbeddingCollection)


def _embedding_param_ids(model: nn.Module) -> set[int]:
    return {
        id(p) for m in model.modules() if isinstance(m, _EMBEDDING_TYPES) for p in m.parameters()
    }


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _extra_flop_rules() -> dict:
    """FlopCounterMode counts the CUDA SDPA kernels but not the CPU flash kernel; count it the same way."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return {} if op is None else {op: _sdpa_flops}


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Number of parameters: ``sparse`` inside TorchRec embedding modules, ``dense`` everything else."""
    sparse_ids = _embedding_param_ids(model)
    counts = {"dense": 0, "sparse": 0}
    for p in model.parameters():
        counts["sparse" if id(p) in sparse_ids else "dense"] += p.numel()
    return counts


@torch.no_grad()
def dense_flops_per_example(model: nn.Module, batch: Batch) -> float:
    """Forward FLOPs per example counted by ``FlopCounterMode`` on one forward of ``batch``.

    Only matmuls / convolutions / attention count, so embedding lookups add nothing: this is the
    dense (FP8-addressable) cost. Backward is about twice this. Ops run once per batch (InterFormer's
    shared PMA query projection) are spread over the examples.
    """
    with FlopCounterMode(display=False, custom_mapping=_extra_flop_rules()) as counter:
        model(batch)
    return counter.get_total_flops() / len(batch)
