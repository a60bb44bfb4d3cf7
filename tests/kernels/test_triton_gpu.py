"""GPU-only: Triton kernels vs the plain-torch references (skipped without CUDA + triton)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from loka_trainer.kernels.mods_ref import fp8_linear_mods_ref, linear_mods_ref, static_fp8_scale
from loka_trainer.kernels.quant import dequantize, quantize

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None
    or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA sm89+ and triton")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("shape", [(256, 512), (100, 300), (2048, 1024)])
def test_quantize_1x128_matches_reference(shape):
    from loka_trainer.kernels.triton_gemm import quantize_1x128
    x = torch.randn(*shape, device="cuda") * 3
    x[1] = 0.0
    q, s = quantize_1x128(x)
    qr, sr = quantize(x, "block1x128")
    torch.testing.assert_close(s, sr)
    assert (q.float() != qr.float()).float().mean() < 1e-3  # rounding ties may differ
    assert torch.isfinite(dequantize(q, s)).all()


@pytest.mark.parametrize("M,K,N", [(256, 256, 256), (512, 384, 640), (2048, 1024, 512)])
@pytest.mark.parametrize("b_gran", ["block1x128", "block128x128"])
def test_blockwise_gemm_matches_dequantized_reference(M, K, N, b_gran):
    from loka_trainer.kernels.triton_gemm import blockwise_mm_nt
    a, b = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
    qa, sa = quantize(a, "block1x128")
    qb, sb = quantize(b, b_gran)
    out = blockwise_mm_nt(qa.contiguous(), sa, qb.contiguous(), sb)
    ref = dequantize(qa, sa) @ dequantize(qb, sb).t()
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2
    assert _rel(out, a @ b.t()) < 0.06


def test_triton_backend_three_gemms():
    from loka_trainer.kernels.backends import get_backend
    from loka_trainer.kernels.dispatch import fp32_reference
    be = get_backend("triton_block1x128")
    assert be.is_available("cuda")
    x, w, dy = (torch.randn(*s, device="cuda") for s in [(512, 256), (384, 256), (512, 384)])
    for gemm, out in [("forward", be.forward(x, w)), ("input_grad", be.input_grad(dy, w)),
                      ("weight_grad", be.weight_grad(dy, x))]:
        assert _rel(out, fp32_reference(gemm, x, w, dy)) < 0.06


@pytest.mark.parametrize("M,K,N", [(1024, 256, 256), (1000, 512, 512), (1024, 4096, 2048), (1024, 256, 7680)])
@pytest.mark.parametrize("block", [256, 128])
def test_fused_mods_bf16_matches_reference(M, K, N, block):
    from loka_trainer.kernels.triton_mods import fused_linear_mods
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    y, q, qs = fused_linear_mods(x, w, block=block, write_fp8=True)
    ref = linear_mods_ref(x, w, block)
    assert _rel(y, ref) < 1e-2
    assert float(qs) == pytest.approx(1.0 / static_fp8_scale(block))
    assert _rel(q.float() * qs, ref) < 0.05  # static-scale FP8 epilogue: no amax pass, bounded error
    assert ref.abs().max() <= block ** 0.5 + 1e-3


@pytest.mark.parametrize("M,K,N", [(1024, 512, 512), (1024, 2048, 4096)])
def test_fused_mods_fp8_inputs_match_reference(M, K, N):
    from loka_trainer.kernels.triton_mods import fused_linear_mods
    x, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
    xq, sx = quantize(x, "rowwise")
    wq, sw = quantize(w, "rowwise")
    y, _, _ = fused_linear_mods(xq, wq, x_scale_inv=sx, w_scale_inv=sw)
    assert _rel(y, fp8_linear_mods_ref(xq, sx, wq, sw)) < 1e-2
    assert _rel(y, linear_mods_ref(x, w)) < 0.06


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_mods_autograd_matches_reference_grads(fp8):
    from loka_trainer.kernels.triton_mods import linear_mods
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    w = (torch.randn(512, 256, device="cuda") / 16).requires_grad_()
    dy = torch.randn(512, 512, device="cuda")
    y = linear_mods(x, w, fp8=fp8)
    (y.float() * dy).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    yr = linear_mods_ref(x, w)
    (yr * dy).sum().backward()
    assert _rel(y, yr) < (0.06 if fp8 else 1e-2)
    assert _rel(gx, x.grad) < 0.03 and _rel(gw, w.grad) < 0.03
