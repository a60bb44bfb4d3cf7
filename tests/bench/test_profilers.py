from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from loka_trainer.bench import BenchOptions, ModuleProvider, run_bench
from loka_trainer.bench.examples import MLPTree
from loka_trainer.bench.plugins import Job
from loka_trainer.bench.preprocessors import BatchReplicate, replicate_batch
from loka_trainer.bench.profilers import BytesMoved, Flops, LatencyForwardBackward, judge
from loka_trainer.bench.runner import make_context
from loka_trainer.bench.tree import ModuleInputs


def _job(module: nn.Module, *args: torch.Tensor, batch_size=None) -> Job:
    return Job("m", module, ModuleInputs(args, {}), batch_size)


@pytest.mark.parametrize("b,k,n", [(4, 8, 16), (3, 5, 7), (32, 64, 1)])
def test_linear_forward_flops_are_2bkn(b, k, n, cpu):
    ctx = make_context(BenchOptions(), cpu, None)
    out = Flops().profile(_job(nn.Linear(k, n), torch.randn(b, k)), ctx, {})
    assert out["flops_fwd"] == 2 * b * k * n
    assert out["flops_fwd_bwd"] == 3 * 2 * b * k * n  # dX and dW are one such GEMM each


def test_leaf_flops_sum_to_parent(fast_opts, cpu):
    model = MLPTree()
    result = run_bench(ModuleProvider(model, torch.randn(8, 16)).get_component(cpu), fast_opts)
    nodes = result.nodes
    for path in ("model", "model.left", "model.right"):
        leaves = [n for p, n in nodes.items() if p.startswith(path + ".") and not n.children]
        assert sum(n.metrics["flops_fwd"] for n in leaves) == nodes[path].metrics["flops_fwd"] > 0


class _SeenGrad(torch.autograd.Function):
    """Identity that records the strides of the gradient its backward receives."""

    strides: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _SeenGrad.strides.append(grad.stride())
        return grad


class _RecordsOutputGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SeenGrad.apply(self.linear(x))


def test_fwd_bwd_backpropagates_a_dense_gradient_not_an_expanded_one(cpu):
    # An expanded (stride-0) seed makes some backward kernels several times slower than in training.
    _SeenGrad.strides.clear()
    ctx = make_context(BenchOptions(warmup=1, repeats=2), cpu, None)
    out = LatencyForwardBackward().profile(_job(_RecordsOutputGrad(), torch.randn(4, 3, 8)), ctx, {})
    assert out["latency_fwd_bwd_ms"] > 0 and len(_SeenGrad.strides) == 3
    assert all(0 not in stride for stride in _SeenGrad.strides), _SeenGrad.strides


def test_a_module_writing_its_input_in_place_is_measured(fast_opts, cpu):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    result = run_bench(ModuleProvider(model, torch.randn(4, 8)).get_component(cpu), fast_opts)
    relu = result.nodes["model.1"]
    assert relu.status == "ok", relu.error
    assert relu.metrics["latency_fwd_ms"] > 0 and relu.metrics["latency_fwd_bwd_ms"] > 0
    assert [n for n in relu.notes if "writes its input in place" in n] == relu.notes and len(relu.notes) == 1
    assert not result.nodes["model.0"].notes  # modules that leave their input alone run on it as before


def test_embedding_bytes_count_rows_read_not_the_table(cpu):
    emb = nn.Embedding(100_000, 16)
    ids = torch.randint(0, 100_000, (8, 3))
    ctx = make_context(BenchOptions(), cpu, None)
    out = BytesMoved().profile(_job(emb, ids), ctx, {})
    rows = 8 * 3 * 16 * 4
    assert out["bytes_moved"] == ids.numel() * 8 + rows + rows  # ids + rows read + output
    assert judge(emb, 0.0) == "bandwidth" and judge(nn.Linear(2, 2), 8.0) == "compute"


def test_embedding_bag_rows_count_when_its_ids_come_by_keyword(cpu):
    # TorchRec's EmbeddingBagCollection calls each table as embedding_bag(input=..., offsets=...)
    bag = nn.EmbeddingBag(100_000, 16, mode="sum")
    ids, offsets = torch.randint(0, 100_000, (24,)), torch.arange(0, 24, 3)
    ctx = make_context(BenchOptions(), cpu, None)
    by_position = BytesMoved().profile(Job("m", bag, ModuleInputs((ids, offsets), {}), None), ctx, {})
    by_keyword = BytesMoved().profile(Job("m", bag, ModuleInputs((), {"input": ids, "offsets": offsets}), None), ctx,
                                      {})
    rows, out = 24 * 16 * 4, 8 * 16 * 4
    assert by_keyword["bytes_moved"] == by_position["bytes_moved"] == ids.numel() * 8 + 8 * 8 + rows + out


def test_replicate_batch_only_scales_batch_dim():
    x, mask = torch.randn(4, 3), torch.ones(5, 5)
    out = replicate_batch((x, mask), batch_size=4, factor=3)
    assert out[0].shape == (12, 3) and torch.equal(out[0][8:], x) and out[1] is mask


class _Masked(nn.Module):
    """A linear layer on the row sums of ``(x @ mask) * scale``: x is (B, F); mask (F, F) and scale (F,) carry no
    batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(((x @ mask) * scale).sum(1, keepdim=True))


@pytest.mark.parametrize("shapes, at", [([(16, 16), (16, 16), (16,)], "(16, 16) has the batch size 16 at dim 1"),
                                        ([(16, 4), (8, 16, 2)], "(8, 16, 2) has the batch size 16 at dim 1")])
def test_replicate_batch_refuses_a_batch_size_at_another_dim(shapes, at):
    with pytest.raises(ValueError, match=re.escape(at)):
        replicate_batch(tuple(torch.ones(s) for s in shapes), batch_size=16, factor=4)


def test_a_module_whose_batch_size_is_also_a_feature_size_fails_with_one_line(cpu):
    x, mask, scale = torch.randn(16, 16), torch.eye(16), torch.ones(16)
    opts = BenchOptions(replicate=4, depth=1, warmup=0, repeats=1, progress=False, profilers=("flops",))
    result = run_bench(ModuleProvider(_Masked(), (x, mask, scale)).get_component(cpu), opts)
    root, leaf = result.nodes["model"], result.nodes["model.linear"]
    assert root.status == "estimated"  # not measured: its FLOPs are its child's
    assert root.error.startswith("preprocessor batch_replicate: ValueError: an input of shape (16, 16) has the "
                                 "batch size 16 at dim 1") and "\n" not in root.error
    assert leaf.status == "ok" and leaf.metrics["flops_fwd"] == 2 * (4 * 16) * 1 * 4  # (16, 1) -> (64, 1)


def test_batch_replicate_scales_flops(cpu):
    ctx = make_context(BenchOptions(), cpu, None)
    job = BatchReplicate(4).apply(_job(nn.Linear(8, 8), torch.randn(2, 8), batch_size=2), ctx)
    assert job.batch_size == 8
    assert Flops().profile(job, ctx, {})["flops_fwd"] == 2 * 8 * 8 * 8


class _DictBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.linear(batch["x"])


@pytest.mark.parametrize("args, kwargs", [(({"x": torch.randn(2, 8)},), None),
                                          ((), {"batch": {"x": torch.randn(2, 8)}})])
def test_batch_replication_finds_the_batch_in_dict_and_keyword_inputs(args, kwargs, cpu):
    component = ModuleProvider(_DictBatch(), args, kwargs).get_component(cpu)
    assert component.batch_size == 2
    opts = BenchOptions(replicate=4, depth=1, warmup=0, repeats=1, progress=False, profilers=("flops",))
    result = run_bench(component, opts)
    assert result.nodes["model.linear"].metrics["flops_fwd"] == 2 * (4 * 2) * 8 * 8


def test_batch_replication_without_a_batch_size_says_so(cpu):
    ctx = make_context(BenchOptions(), cpu, None)
    job = BatchReplicate(4).apply(_job(nn.Linear(8, 8), torch.randn(2, 8)), ctx)
    assert job.batch_size is None and "batch replication needs the inputs' batch size" in job.notes[0]


def test_bf16_precision_runs_under_autocast(cpu):
    opts = BenchOptions(precision="bf16", warmup=0, repeats=1, progress=False, depth=1)
    result = run_bench(ModuleProvider(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)).get_component(cpu), opts)
    assert result.compute_dtype == "bf16" and all(n.status == "ok" for n in result.bfs())


def test_unknown_names_are_one_line_value_errors():
    with pytest.raises(ValueError, match="bench.precision"):
        BenchOptions(precision="fp4")
    with pytest.raises(ValueError, match="bench.profilers='nope'.*valid values"):
        from loka_trainer.bench.plugins import make
        from loka_trainer.bench.profilers import PROFILERS
        make(PROFILERS, "nope", "bench.profilers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory_sees_a_temporary_freed_inside_the_call():
    from loka_trainer.bench.profilers import cuda_peak_memory
    device = torch.device("cuda", 0)
    kept = torch.empty(2**20, dtype=torch.uint8, device=device)
    mem = cuda_peak_memory(lambda: torch.empty(64 * 2**20, dtype=torch.uint8, device=device), device)
    assert mem.before >= kept.numel() and mem.peak - mem.before >= 64 * 2**20 and mem.peak_reserved >= mem.peak
