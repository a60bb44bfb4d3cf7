"""GPU-only: the FP8 paths of the fused Mods layer (split_fp8 forward, dz+quantization dgrad kernels) and its
backward GEMMs on two streams.

Skipped without CUDA sm89+ and triton; the same kernels run on CPU in test_mods_fp8_interp.py.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from loka_trainer.mods.reference import linear_mods_ref

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None
    or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA sm89+ and triton")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _du(M: int, N: int, block: int):
    """A realistic (dh, u, r): u, r from the forward epilogue of a random z, dh random; row 3 of dh zero."""
    from loka_trainer.mods.ops import mods_forward_ref
    z = torch.randn(M, N, device="cuda") * 2
    _, u, r = mods_forward_ref(z, block, 1e-6)
    dh = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dh[3] = 0.0
    return dh, u, r


@pytest.mark.parametrize("M,N,block", [(1024, 4096, 256), (1000, 512, 128), (77, 256, 256)])
@pytest.mark.parametrize("write_bf16", [True, False])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_backward_dz_fp8_matches_reference(M, N, block, write_bf16, granularity):
    from loka_trainer.mods.ops_fp8 import mods_backward_fp8_ref
    from loka_trainer.mods.triton_mods import backward_dz_fp8
    dh, u, r = _du(M, N, block)
    sx = torch.logspace(-2, 2, M, device="cuda")[:, None]  # the forward's row scales of x (folded weight grad)
    q, s, dz, (dzt, st) = backward_dz_fp8(dh, u, r, block=block, write_bf16=write_bf16, granularity=granularity,
                                          fold_sx=sx)
    qr, sr, dzr, (dzt_r, st_r) = mods_backward_fp8_ref(dh, u, r, block, granularity, sx)
    torch.testing.assert_close(st, st_r, rtol=1e-2, atol=0)
    assert (dzt.float() != dzt_r.float()).float().mean() < 1e-2
    assert q.dtype == qr.dtype and s.shape == sr.shape
    torch.testing.assert_close(s, sr, rtol=1e-2, atol=0)  # dz's bf16 rounding may differ by an ulp
    assert (q.float() != qr.float()).float().mean() < 1e-2
    assert _rel(q.float() * s, dzr) < 1.1 * _rel(qr.float() * sr, dzr)
    assert torch.isfinite(s).all() and (q[3].float() == 0).all()
    assert (dz is None) != write_bf16
    if write_bf16:
        assert _rel(dz, dzr) < 1e-2


@pytest.mark.parametrize("M,K,N", [(1024, 512, 1024), (256, 4096, 2048), (1000, 256, 512)])
@pytest.mark.parametrize("mode,dgrad,wgrad", [("split_fp8", "bf16", "bf16"),
                                              ("split_fp8", "scaled_mm_rowwise", "bf16"),
                                              ("split_bf16", "scaled_mm_tensorwise", "bf16"),
                                              ("fused_fp8", "scaled_mm_rowwise", "scaled_mm_rowwise"),
                                              ("split_fp8", "scaled_mm_rowwise", "scaled_mm_tensorwise"),
                                              ("fused_fp8", "bf16", "scaled_mm_tensorwise"),
                                              ("split_fp8", "scaled_mm_rowwise_fast_accum",
                                               "scaled_mm_tensorwise_fast_accum"),
                                              ("split_bf16", "scaled_mm_tensorwise_fast_accum", "bf16")])
def test_linear_mods_fp8_modes_match_fp32(M, K, N, mode, dgrad, wgrad):
    from loka_trainer.mods.ops import linear_mods
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, device="cuda")
    y = linear_mods(x, w, mode=mode, dgrad=dgrad, wgrad=wgrad)
    y.backward(dy.to(torch.bfloat16))
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yr = linear_mods_ref(xr, wr)
    yr.backward(dy)
    assert _rel(y.detach(), yr.detach()) < 0.06
    assert _rel(x.grad, xr.grad) < 0.08 and _rel(w.grad, wr.grad) < 0.08


@pytest.mark.parametrize("backend", ["scaled_mm_rowwise", "scaled_mm_tensorwise", "scaled_mm_rowwise_fast_accum",
                                     "scaled_mm_tensorwise_fast_accum"])
def test_fused_dgrad_equals_unfused_backend(backend):
    """Same numerics as the backend: fused dz-quant + _scaled_mm vs backend.input_grad on the bf16 dz."""
    from loka_trainer.kernels.backends import get_backend
    from loka_trainer.kernels.linear import WeightCache
    from loka_trainer.mods.ops import mods_bwd_dz
    from loka_trainer.mods.ops_fp8 import FUSED_DGRAD
    dh, u, r = _du(1024, 2048, 256)
    w = (torch.randn(2048, 512, device="cuda") / 512 ** 0.5).to(torch.bfloat16)
    cache = WeightCache()
    dx_fn, dz, _ = FUSED_DGRAD[backend](dh, u, r, 256, w, cache, True)
    dx = dx_fn()
    be = get_backend(backend)
    ref = be.input_grad(mods_bwd_dz(dh, u, r, 256), w, wt_q=cache.get(w, backend, "input_grad"))
    assert dx.shape == (1024, 512) and dz.shape == (1024, 2048)
    assert _rel(dx, ref) < 1e-2 and cache.num_casts == 1


def test_split_fp8_compiles():
    from loka_trainer.kernels.linear import WeightCache
    from loka_trainer.mods.ops import linear_mods
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(512, 256, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    cache = WeightCache()
    f = lambda t: linear_mods(t, w, mode="split_fp8", dgrad="scaled_mm_rowwise", cache=cache)
    y = torch.compile(f, fullgraph=False)(x)
    y.float().sum().backward()
    assert _rel(y.detach(), linear_mods_ref(x.detach(), w.detach())) < 0.06 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("mode_first", ["split_bf16", "split_fp8"])
def test_fp8_handoff_matches_unchained_stack(mode_first):
    from torch import nn

    from loka_trainer.mods.module import FusedLinearMods
    from loka_trainer.mods.transform import chain_fp8_handoffs

    def stack():
        torch.manual_seed(0)
        return nn.Sequential(FusedLinearMods(512, 1024, mode=mode_first, device="cuda", dtype=torch.bfloat16),
                             nn.Identity(), nn.Identity(),
                             FusedLinearMods(1024, 512, mode="split_fp8", device="cuda", dtype=torch.bfloat16))

    plain, chained = stack(), stack()
    assert chain_fp8_handoffs(chained) == [("0", "3")]
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for model in (plain, chained):
        xr = x.clone().requires_grad_()
        y = model(xr)
        y.float().square().mean().backward()
        results.append((y.detach(), xr.grad, model[0].weight.grad, model[3].weight.grad))
    assert chained[0]._handoff is None
    for got, ref in zip(results[1], results[0]):
        assert torch.isfinite(got.float()).all() and _rel(got, ref) < 0.06


@pytest.mark.parametrize("mode", ["fused_bf16", "split_bf16", "fused_fp8", "split_fp8"])
def test_inference_forward_equals_training_forward(mode):
    from loka_trainer.mods.ops import linear_mods
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(1024, 512, device="cuda") / 512 ** 0.5).to(torch.bfloat16).requires_grad_()
    y_train = linear_mods(x, w, mode=mode)
    with torch.no_grad():
        y_infer = linear_mods(x, w, mode=mode)
    # The fused kernel autotunes save / no-save separately: another K tile may change the FP8 accumulation
    # order, so equal up to rounding, not bit for bit; a wrong or missing write would be O(1) off.
    assert _rel(y_infer, y_train.detach()) < 1e-2


def test_lokalayers_compile_into_one_graph():
    # A graph break inside a LoKA layer (e.g. a find_spec call on the Triton path) makes every compiled step
    # launch-bound; fullgraph=True turns one into an error.
    from torch import nn

    from loka_trainer.kernels.linear import LoKALinear
    from loka_trainer.mods.module import FusedLinearMods

    torch.manual_seed(0)
    fp8 = {"forward": "scaled_mm_rowwise", "input_grad": "scaled_mm_rowwise", "weight_grad": "scaled_mm_rowwise"}
    model = nn.Sequential(
        FusedLinearMods(256, 512, mode="fused_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_rowwise",
                        device="cuda", dtype=torch.bfloat16),
        LoKALinear(512, 256, bias=False, backends=fp8, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    compiled.float().square().mean().backward()
    assert _rel(compiled.detach(), eager.detach()) < 1e-2
    assert torch.isfinite(x.grad).all() and torch.isfinite(model[0].weight.grad).all()


def test_plan_times_the_forward_modes_and_input_grads_of_fused_layers():
    from torch import nn

    from loka_trainer.models.layers import mlp
    from loka_trainer.mods.module import FusedLinearMods
    from loka_trainer.precision import PrecisionConfig, apply_precision

    torch.manual_seed(0)
    model = nn.Sequential(mlp(256, [512, 256], bias=False, norm="blocknorm", activation="hardswish",
                              block_size=256), nn.Linear(256, 1)).cuda()
    cfg = PrecisionConfig(name="loka", mods=True, dispatch=True, backends=["scaled_mm_rowwise"])
    plan = apply_precision(model, config=cfg, device="cuda", calibration_batch=torch.randn(1024, 256, device="cuda"),
                           log=lambda s: None)
    for fqn, i in (("0.0", 0), ("0.3", 3)):
        choice = plan.layers[fqn].mods_forward
        assert choice is not None and choice.times_us["split_bf16"] > 0 and choice.times_us["fused_bf16"] > 0
        assert model[0][i].mode == choice.mode and isinstance(model[0][i], FusedLinearMods)
        # the fused FP8 dgrad is accurate on this data, so the layer's whole step was timed with it and with BF16
        dgrad = plan.layers[fqn].mods_input_grad
        assert dgrad is not None and dgrad.times_us["bf16"] > 0 and dgrad.times_us["scaled_mm_rowwise"] > 0
        assert model[0][i].dgrad == dgrad.mode


def _assert_two_streams_equal_in_order(step, leaves):
    """``step(config)`` (forward + backward with that ``ModsKernelConfig``) gives bit-equal grads of ``leaves`` with the
    backward's two GEMMs on two streams and in order, and the same again when captured in a CUDA graph (fork/join as
    graph edges) and replayed."""
    from loka_trainer.mods.config import ModsKernelConfig

    def grads(enabled: bool):
        for t in leaves:
            t.grad = None
        step(ModsKernelConfig(backward_streams=enabled))
        return [t.grad.clone() for t in leaves]
    concurrent, serial = grads(True), grads(False)
    assert all(torch.equal(a, b) for a, b in zip(concurrent, serial))  # same kernels, only the streams differ
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grads(True)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(g):
        step(ModsKernelConfig())
    for t in leaves:
        t.grad.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(t.grad, c) for t, c in zip(leaves, concurrent))


@pytest.mark.parametrize("kw", [dict(mode="split_bf16"), dict(mode="split_fp8", dgrad="scaled_mm_rowwise"),
                                dict(mode="split_bf16", dgrad="scaled_mm_tensorwise"),
                                dict(mode="split_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_rowwise"),
                                dict(mode="split_fp8", dgrad="scaled_mm_tensorwise", wgrad="scaled_mm_tensorwise")])
def test_grads_on_two_streams_equal_grads_in_order_also_under_graph_replay(kw):
    from loka_trainer.kernels.linear import WeightCache
    from loka_trainer.mods.ops import linear_mods
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(768, 512, device="cuda") / 23).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
    cache = WeightCache()
    _assert_two_streams_equal_in_order(lambda config: linear_mods(x, w, cache=cache, config=config, **kw).backward(dy),
                                       [x, w])


@pytest.mark.parametrize("M,N,K", [(1024, 2048, 4096), (1000, 256, 7680), (64, 320, 96)])
def test_fold_operands_match_reference(M, N, K):
    from loka_trainer.kernels.quant import quantize_rowwise
    from loka_trainer.mods.wgrad_fold import fold_operands, fold_operands_ref
    dz = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dz[5] *= 1000.0
    xq, sx = quantize_rowwise(torch.randn(M, K, device="cuda") * torch.logspace(-2, 2, M, device="cuda")[:, None],
                              torch.float8_e4m3fn)
    dzt, s, xqt = fold_operands(dz, xq, sx)
    dzt_r, s_r, xqt_r = fold_operands_ref(dz, xq, sx)
    torch.testing.assert_close(s, s_r, rtol=1e-6, atol=0)
    assert torch.equal(xqt.view(torch.uint8), xqt_r.view(torch.uint8))
    assert (dzt.view(torch.uint8) != dzt_r.view(torch.uint8)).float().mean() < 1e-3
