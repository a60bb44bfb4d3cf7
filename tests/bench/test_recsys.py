"""The benchmark on a zoo-style model whose forward takes a Batch with a TorchRec KJT inside."""
from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from loka_trainer.bench import BenchOptions, ModuleProvider, Profiler, run_bench
from loka_trainer.bench.plugins import Job
from loka_trainer.bench.preprocessors import BatchReplicate, batch_size_of, replicate_batch
from loka_trainer.bench.runner import make_context
from loka_trainer.bench.tree import ModuleInputs
from loka_trainer.data.batch import Batch, DataSchema


def _dlrm_and_batch(batch_size: int = 6):
    from loka_trainer.models.dlrm import DLRMConfig, build_dlrm

    schema = DataSchema(num_dense=4, sparse_features=("a", "b"), sparse_vocab_sizes=(50, 30))
    model = build_dlrm(DLRMConfig(embedding_dim=8, dense_arch_widths=[16, 8], over_arch_widths=[16, 8]),
                       schema=schema, loka_mods=False)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.randint(0, 30, (2 * batch_size,)),
                            lengths=torch.ones(2 * batch_size, dtype=torch.int64))
    return model, Batch(dense=torch.randn(batch_size, 4), sparse=kjt, labels=torch.zeros(batch_size))


def test_batch_and_kjt_inputs_are_replayed_and_replicated(cpu):
    model, batch = _dlrm_and_batch()
    opts = BenchOptions(depth=2, warmup=0, repeats=1, progress=False, replicate=2, profilers=("flops",))
    result = run_bench(ModuleProvider(model, batch, batch_size=6).get_component(cpu), opts)
    nodes = result.nodes
    paths = ("model", "model.sparse_arch", "model.dense_arch", "model.sparse_arch.ebc", "model.over_arch")
    assert all(nodes[p].status == "ok" for p in paths)
    assert not [n for p in paths for n in nodes[p].notes if "replication" in n]
    assert nodes["model.sparse_arch"].judged_by == "bandwidth" and nodes["model.sparse_arch"].metrics["mfu_pct"] is None
    # Every part ran at batch 12, the root too (its Batch's dense, KJT and labels scaled alike): its FLOPs are
    # the sum of its children's, and the bottom MLP's are those of batch 12.
    assert nodes["model.dense_arch"].metrics["flops_fwd"] == 2 * 12 * (4 * 16 + 16 * 8)
    children = [nodes[c].metrics["flops_fwd"] for c in nodes["model"].children]
    assert nodes["model"].metrics["flops_fwd"] == sum(children) > 0


def _kjt(batch_size: int, weighted: bool = False) -> KeyedJaggedTensor:
    """Keys a, b over ``batch_size`` rows, row lengths 0..2 (some rows empty), ids < 10."""
    lengths = torch.arange(2 * batch_size) % 3
    values = torch.arange(int(lengths.sum())) % 10
    return KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths,
                             weights=torch.rand(values.shape) if weighted else None)


@pytest.mark.parametrize("weighted", [False, True])
def test_an_ebc_under_replicate_3_sees_stride_3b_and_the_original_rows_repeated(weighted, cpu):
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=4, num_embeddings=10, feature_names=[k])
              for k in ("a", "b")]
    ebc, kjt = EmbeddingBagCollection(tables=tables, is_weighted=weighted), _kjt(5, weighted)
    job = BatchReplicate(3).apply(Job("m", ebc, ModuleInputs((kjt,), {}), 5), make_context(BenchOptions(), cpu, None))
    (scaled,) = job.inputs.args
    assert job.batch_size == 15 and scaled.stride() == 15 and not job.notes
    assert scaled.length_per_key() == [3 * n for n in kjt.length_per_key()]
    assert torch.equal(job.run().values(), ebc(kjt).values().repeat(3, 1))


def test_a_batch_is_replicated_field_by_field_consistently():
    batch = Batch(dense=torch.randn(4, 3), sparse=_kjt(4), labels=torch.arange(4.0), sequences=_kjt(4))
    (out,) = replicate_batch((batch,), batch_size=4, factor=2)
    assert isinstance(out, Batch) and len(out) == 8 and torch.equal(out.labels, batch.labels.repeat(2))
    assert torch.equal(out.dense, batch.dense.repeat(2, 1))
    for scaled, kjt in ((out.sparse, batch.sparse), (out.sequences, batch.sequences)):
        assert scaled.stride() == 8
        for key in kjt.keys():
            rows = [row.tolist() for row in kjt[key].to_dense()]
            assert [row.tolist() for row in scaled[key].to_dense()] == rows * 2


def test_a_batch_with_its_batch_size_at_another_dim_of_dense_is_refused():
    batch = Batch(dense=torch.randn(4, 4), sparse=_kjt(4), labels=torch.zeros(4))
    with pytest.raises(ValueError, match=r"an input of shape \(4, 4\) has the batch size 4 at dim 1"):
        replicate_batch((batch,), batch_size=4, factor=2)


def test_kjt_of_another_stride_is_left_alone_and_keyed_tensor_values_are_scaled():
    kjt = _kjt(3)
    kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=torch.randn(4, 5))
    out_kjt, out_kt = replicate_batch((kjt, kt), batch_size=4, factor=2)
    assert out_kjt is kjt
    assert out_kt.keys() == ["a", "b"] and torch.equal(out_kt.values(), kt.values().repeat(2, 1))


def test_a_variable_batch_kjt_runs_as_captured_with_a_note(cpu):
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=torch.tensor([1, 1, 1, 2]),
                            stride_per_key_per_rank=[[1], [3]])
    job = BatchReplicate(2).apply(Job("m", torch.nn.Identity(), ModuleInputs((kjt,), {}), 3),
                                  make_context(BenchOptions(), cpu, None))
    assert job.inputs.args[0] is kjt and job.batch_size == 3
    assert job.notes == ["batch replication unsupported for variable-batch KeyedJaggedTensor input; ran at the "
                         "captured batch 3"]


class _InputStride(Profiler):
    """Records the stride of the KJT each job replays (its first positional input)."""

    name = "input_stride"

    def profile(self, job, ctx, so_far):
        return {"input_stride": job.inputs.args[0].stride()}


def test_module_provider_of_an_ebc_and_a_kjt_replicates_it_without_a_batch_size(cpu):
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=4, num_embeddings=10, feature_names=[k])
              for k in ("a", "b")]
    ebc, kjt = EmbeddingBagCollection(tables=tables), _kjt(5)
    component = ModuleProvider(ebc, kjt).get_component(cpu)
    assert component.batch_size == 5
    opts = BenchOptions(depth=0, warmup=0, repeats=1, progress=False, replicate=2)
    root = run_bench(component, opts, profilers=[_InputStride()]).nodes["model"]
    assert root.status == "ok" and root.metrics["input_stride"] == 10
    assert not [n for n in root.notes if "replication" in n]


def test_module_provider_takes_the_batch_size_of_a_batch_input(cpu):
    model, batch = _dlrm_and_batch()
    assert ModuleProvider(model, batch).get_component(cpu).batch_size == 6


def test_batch_size_of_kjts_keyed_tensors_and_batches():
    kjt = _kjt(4)
    var = KeyedJaggedTensor(keys=["a", "b"], values=torch.arange(5), lengths=torch.tensor([1, 1, 1, 2]),
                            stride_per_key_per_rank=[[1], [3]])
    kt = KeyedTensor(keys=["a", "b"], length_per_key=[2, 3], values=torch.randn(7, 5))
    batch = Batch(dense=torch.randn(3, 2), sparse=_kjt(3), labels=torch.zeros(3))
    assert batch_size_of(((kjt,), {})) == 4 and batch_size_of((kt,)) == 7 and batch_size_of([batch]) == 3
    assert batch_size_of((var, torch.tensor(1.0), torch.nn.Identity())) is None
    assert batch_size_of((var, {"x": torch.randn(9, 2)})) == 9
