"""The fused rowwise quantizer off Triton (the interpreter cases are in interp_cases.py)."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.kernels.quant import quantize_rowwise
from loka_trainer.kernels.triton_quant import quantize_rowwise_fused


def test_off_triton_falls_back_to_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(16, 32)
    q, s = quantize_rowwise_fused(x.t())
    qr, sr = quantize_rowwise(x.t(), torch.float8_e4m3fn)
    assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr) and q.is_contiguous()


def test_use_triton_traces_without_a_graph_break():
    # use_triton runs inside compiled LoKA layers; a find_spec call there broke every layer's graph.
    from loka_trainer.kernels.triton_env import use_triton

    @torch.compile(fullgraph=True, backend="eager")
    def pick(t):
        return t + 1 if use_triton(t) else t - 1

    assert torch.equal(pick(torch.zeros(4)), -torch.ones(4))


def test_quant_op_compiled_equals_eager_and_leaves_its_input_alone(monkeypatch):
    # loka::quant_rowwise is a triton_op: compiled, inductor traces its body (here the reference path)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from loka_trainer.kernels.triton_quant import quant_rowwise

    x = torch.randn(64, 96, dtype=torch.bfloat16)
    before = x.clone()
    q, s = quant_rowwise(x)
    qc, sc = torch.compile(lambda t: quant_rowwise(t), fullgraph=True)(x)
    assert q.dtype == qc.dtype == torch.float8_e4m3fn and s.shape == sc.shape == (64, 1)
    assert torch.equal(q.view(torch.uint8), qc.view(torch.uint8)) and torch.equal(s, sc)
    assert torch.equal(x, before)


def test_launcher_wraps_only_traced_launches():
    # eager: the kernel itself (no higher-order-op dispatch per launch); traced (fake tensors): wrap_triton's wrapper
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loka_trainer.kernels.triton_env import launcher
    from loka_trainer.kernels.triton_quant_kernels import quant_rowwise_kernel as kernel
    assert launcher(kernel, torch.zeros(2, 2)) is kernel
    with FakeTensorMode():
        fake = torch.empty(2, 2)
    wrapped = launcher(kernel, fake)
    assert wrapped is not kernel and type(wrapped).__name__ == "TraceableTritonKernelWrapper"
