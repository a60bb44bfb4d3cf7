"""GPU-only: the grouped backward GEMMs (``triton_grads``) vs torch, and in the Mods layer's backward."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.kernels.cuda_graphs import replayed

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None
    or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA sm89+ and triton")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("M,K,N", [(1024, 256, 256), (1024, 512, 512), (1000, 400, 256), (48, 256, 512)])
def test_grads_match_torch_with_every_config(M, K, N):
    # (1000, 400, ...): ragged row and K tiles; M = 48: fewer rows than one tile
    from loka_trainer.mods import triton_grads
    g = torch.Generator(device="cuda").manual_seed(0)
    dz, x, w = (torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16) for s in ((M, N), (M, K), (N, K)))
    dx_ref, dw_ref = dz.float() @ w.float(), dz.float().t() @ x.float()
    configs = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
               for c in triton_grads._kernel().configs]
    for config in [None, *configs]:
        dx, dw = triton_grads.grads(dz, x, w, config=config)
        assert dx.dtype == dw.dtype == torch.bfloat16, config
        assert _rel(dx, dx_ref) < 1e-2 and _rel(dw, dw_ref) < 1e-2, config


def test_layer_backward_uses_them_and_matches_cublas_eager_and_in_a_graph(monkeypatch):
    from loka_trainer.mods import triton_grads
    from loka_trainer.mods.ops import linear_mods
    torch.manual_seed(0)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(512, 512, device="cuda") / 22).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    calls = []
    grads = triton_grads.grads
    monkeypatch.setattr(triton_grads, "grads", lambda *a, **k: calls.append(1) or grads(*a, **k))

    def step():
        x.grad = w.grad = None
        linear_mods(x, w, mode="split_bf16").backward(dy)
        return x.grad, w.grad

    grouped = [t.clone() for t in step()]
    assert calls == [1]
    with monkeypatch.context() as m:  # the same layer on cuBLAS
        m.setattr(triton_grads, "applies", lambda *a: False)
        cublas = [t.clone() for t in step()]
    assert calls == [1]
    for a, b in zip(grouped, cublas):
        assert _rel(a, b) < 1e-2
    for a, b in zip(replayed(step), grouped):
        assert torch.equal(a, b)  # same kernels, no atomics: bit-identical
