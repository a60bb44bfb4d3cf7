"""The folded FP8 weight grad (``wgrad_fold``) on CPU: its error against the tensorwise backend's, and what the
layer keeps for it. The Triton kernels' cases run under the interpreter in test_mods_fp8_interp.py."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.kernels.backends import get_backend
from loka_trainer.kernels.mods_ops import linear_mods
from loka_trainer.kernels.mods_ref import linear_mods_ref
from loka_trainer.kernels.quant import quantize_rowwise
from loka_trainer.kernels.wgrad_fold import wgrad_fold

M, K, N, B = 64, 96, 128, 64


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("row_spread", [0.0, 2.0])  # x rows of equal size, or spread over 10^±2
def test_fold_error_is_no_worse_than_tensorwise_backend(row_spread):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-row_spread, row_spread, M)[:, None]).to(torch.bfloat16)
    dz = torch.randn(M, N, generator=g).to(torch.bfloat16)
    exact = dz.double().t() @ x.double()
    xq, sx = quantize_rowwise(x, torch.float8_e4m3fn)
    folded = wgrad_fold(dz, xq, sx)
    backend = get_backend("scaled_mm_tensorwise").weight_grad(dz, x)
    assert folded.shape == (N, K) and folded.dtype == torch.bfloat16
    assert _rel(folded, exact) < 0.1
    assert _rel(folded, exact) <= 1.1 * _rel(backend, exact)


@pytest.mark.parametrize("mode", ["split_fp8", "fused_fp8"])
def test_fp8_forward_with_tensorwise_wgrad_keeps_fp8_x_not_x(mode):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = linear_mods(x, w, block=B, mode=mode, wgrad="scaled_mm_tensorwise")
    y.float().square().sum().backward()
    shapes = {(tuple(t.shape), t.dtype) for t in saved}
    assert ((M, K), torch.float8_e4m3fn) in shapes and ((M, K), torch.bfloat16) not in shapes
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    linear_mods_ref(xr, wr, B).square().sum().backward()
    assert _rel(w.grad, wr.grad) < 0.1 and _rel(x.grad, xr.grad) < 0.1
