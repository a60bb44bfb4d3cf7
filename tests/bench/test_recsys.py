"""The benchmark on a zoo-style model whose forward takes a Batch with a TorchRec KJT inside."""
from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.bench import BenchOptions, ModuleProvider, run_bench
from loka_trainer.data.batch import Batch, DataSchema


def _dlrm_and_batch(batch_size: int = 6):
    from loka_trainer.models.dlrm import DLRMConfig, build_dlrm

    schema = DataSchema(num_dense=4, sparse_features=("a", "b"), sparse_vocab_sizes=(50, 30))
    model = build_dlrm(DLRMConfig(embedding_dim=8, dense_arch_widths=[16, 8], over_arch_widths=[16, 8]),
                       schema=schema, loka_mods=False)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.randint(0, 30, (2 * batch_size,)),
                            lengths=torch.ones(2 * batch_size, dtype=torch.int64))
    return model, Batch(dense=torch.randn(batch_size, 4), sparse=kjt, labels=torch.zeros(batch_size))


def test_batch_and_kjt_inputs_are_replayed_and_replication_is_reported(cpu):
    model, batch = _dlrm_and_batch()
    opts = BenchOptions(depth=2, warmup=0, repeats=1, progress=False, replicate=2)
    result = run_bench(ModuleProvider(model, batch, batch_size=6).get_component(cpu), opts)
    nodes = result.nodes
    assert all(nodes[p].status == "ok" for p in ("model", "model.sparse_arch", "model.dense_arch",
                                                 "model.sparse_arch.ebc", "model.over_arch"))
    assert any("replication unsupported for KeyedJaggedTensor" in n for n in nodes["model.sparse_arch"].notes)
    assert nodes["model.sparse_arch"].judged_by == "bandwidth" and nodes["model.sparse_arch"].metrics["mfu_pct"] is None
    # Dense parts were replicated 2x: the bottom MLP's FLOPs are those of batch 12.
    assert nodes["model.dense_arch"].metrics["flops_fwd"] == 2 * 12 * (4 * 16 + 16 * 8)
