"""GPU-only: ``timing.cuda_graph_us``, the CUDA-graph timer of Dispatch and the benchmarks. It times what it is
given, frees a first call's reference cycles before capturing, and however often it runs leaves no more than one
stream's cuBLAS workspace allocated (cuBLAS keeps one per stream for the life of the process)."""
from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs CUDA and triton")

MIB = 2 ** 20


def test_graph_time_grows_with_the_work_timed():
    from loka_trainer.timing import cuda_graph_us
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    one = cuda_graph_us(lambda: a @ a)
    four = cuda_graph_us(lambda: [a @ a for _ in range(4)])
    assert 0 < one and 3.0 < four / one < 5.0


def test_timing_many_calls_leaves_one_streams_workspace_at_most():
    """Triton's do_bench_cudagraph took a new pool stream per call: 40 timings of a GEMM left a cuBLAS workspace
    on each of torch's pool streams (2.0 GiB after Dispatch planned wukong_h200 on the H200)."""
    from loka_trainer.timing import cuda_graph_us
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    a @ a
    cuda_graph_us(lambda: a @ a)  # this process's timing stream gets its workspace
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    for _ in range(40):
        cuda_graph_us(lambda: a @ a, rep_ms=1)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 8 * MIB


def test_first_calls_reference_cycles_are_freed_before_the_timed_calls():
    """A first call's autograd graph kept alive by a reference cycle held AccumulateGrad nodes from the default
    stream into the capture (capture invalidated on the H200): the cycle is gone when the next call starts."""
    from loka_trainer.timing import cuda_graph_us
    refs, alive_at_next_call = [], []

    class Node:
        pass

    def step():
        if refs:
            alive_at_next_call.append(refs[0]() is not None)
        node = Node()
        node.self = node  # a cycle: freed only by the garbage collector
        refs.append(weakref.ref(node))
        torch.cuda._sleep(1000)
    gc.disable()
    try:
        assert cuda_graph_us(step, rep_ms=1) > 0
    finally:
        gc.enable()
    assert alive_at_next_call and alive_at_next_call[0] is False


def test_fresh_gradients_each_captured_call():
    """grad_to_none: every captured backward writes a fresh .grad (as after zero_grad(set_to_none=True)), so the
    gradient after timing is one call's, not the sum of all."""
    from loka_trainer.timing import cuda_graph_us
    w = torch.ones(64, device="cuda", requires_grad=True)
    cuda_graph_us(lambda: (w * 3.0).sum().backward(), rep_ms=1, grad_to_none=[w])
    torch.testing.assert_close(w.grad, torch.full_like(w, 3.0))


def test_dispatch_leaves_no_timing_workspaces_behind():
    """convert_to_loka with Dispatch timing a compiled 3-layer Mods stack on the GPU: with triton's timer it left
    1193 MiB allocated on the H200, 131 MiB with one timing stream (the workspaces of two streams and the plan's
    small state)."""
    from torch import nn

    from loka_trainer import LoKAConfig, convert_to_loka
    from loka_trainer.mods.layers import BlockNorm
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (nn.Linear(2048, 2048, bias=False), BlockNorm(2048, 256), nn.Hardswish())]
    model = nn.Sequential(*layers).to("cuda", torch.bfloat16)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    config = LoKAConfig(compute_dtype="bfloat16", mods=True, dispatch=True, min_features=16, compile=True)
    convert_to_loka(model, config, calibration_batch=x, device="cuda", log=lambda _: None)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 256 * MIB
