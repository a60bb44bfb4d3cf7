"""GPU-only: the one-kernel BF16 backward of a small Mods layer (``triton_mods_bwd``) vs dz + two GEMMs."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None
    or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA sm89+ and triton")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _layer(M: int, K: int, N: int, block: int = 256):
    from loka_trainer.kernels.mods_ops import mods_forward_ref
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)
    _, u, r = mods_forward_ref(x.float() @ w.float().t(), block, 1e-6)
    return x, w, dy, u, r


@pytest.mark.parametrize("M,K,N", [(1024, 256, 256), (1000, 512, 512), (1024, 400, 256), (48, 256, 512)])
def test_one_kernel_backward_matches_dz_and_gemms(M, K, N):
    # (1000, ...): ragged row tiles; K = 400: a partial K tile; M = 48: most M splits own no rows
    from loka_trainer.kernels import triton_mods_bwd
    from loka_trainer.kernels.mods_ops import mods_backward_ref
    x, w, dy, u, r = _layer(M, K, N)
    dz = mods_backward_ref(dy, u, r, 256).float()
    dx_ref, dw_ref = dz @ w.float(), dz.t() @ x.float()
    ws, count = triton_mods_bwd._workspace(x.device, N, K)
    configs = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
               for c in triton_mods_bwd._kernel().configs]
    for config in [None, *configs]:
        dx, dw = triton_mods_bwd.backward_one_kernel(dy, u, r, x, w, block=256, config=config)
        assert dx.dtype == dw.dtype == torch.bfloat16, config
        assert _rel(dx, dx_ref) < 1e-2 and _rel(dw, dw_ref) < 1e-2, config
        # the last program of each dW tile leaves the workspace and its counter clean for the next launch
        torch.cuda.synchronize()
        assert int(count.abs().max()) == 0 and float(ws.abs().max()) == 0.0, config


def test_linear_mods_backward_one_kernel_matches_unfused_and_replays_in_a_graph(monkeypatch):
    from loka_trainer.kernels import triton_mods_bwd
    from loka_trainer.kernels.mods_ops import linear_mods
    torch.manual_seed(0)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(512, 512, device="cuda") / 22).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = w.grad = None
        linear_mods(x, w, mode="split_bf16").backward(dy)
        return x.grad, w.grad

    assert triton_mods_bwd.applies(1024, 512, 512, 256)
    one = [t.clone() for t in step()]
    monkeypatch.setattr(triton_mods_bwd, "ENABLED", False)
    unfused = [t.clone() for t in step()]
    for a, b in zip(one, unfused):
        assert _rel(a, b) < 1e-2
    monkeypatch.setattr(triton_mods_bwd, "ENABLED", True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream (its workspace is made outside the capture)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, one):
        assert _rel(a, b) < 1e-3  # the same kernel: only dW's fp32 addition order may differ
