"""Plain-torch twins of the fused Mods kernels: forward and the closed-form dz against autograd; every forward
mode and the fused FP8 dgrad on their plain-torch (CPU) paths."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from loka_trainer.kernels.quant import quantize
from loka_trainer.mods.modes import FORWARD_MODES
from loka_trainer.mods.ops import linear_mods, mods_backward_ref, mods_forward_ref
from loka_trainer.mods.ops_fp8 import mods_bwd_dz_fp8
from loka_trainer.mods.reference import block_norm, hard_swish, linear_mods_ref


@pytest.mark.parametrize("block", [16, 64])
def test_closed_form_dz_matches_autograd(block):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(24, 128, generator=g) * 2).double().requires_grad_()
    dh = torch.randn(24, 128, generator=g).double()
    hard_swish(block_norm(z, block)).backward(dh)
    _, u, r = mods_forward_ref(z.detach(), block, 1e-6)
    # u is stored in bf16 (what the kernel saves), so compare at bf16 precision
    assert float((mods_backward_ref(dh, u, r, block).double() - z.grad).norm() / z.grad.norm()) < 1e-2


def test_forward_ref_matches_mods_reference():
    z = torch.randn(8, 512)
    h, u, r = mods_forward_ref(z, 256, 1e-6)
    torch.testing.assert_close(h.float(), hard_swish(block_norm(z, 256)), rtol=1e-2, atol=1e-2)
    assert r.shape == (8, 2) and torch.allclose(u.float().unflatten(-1, (2, 256)).square().mean(-1),
                                                torch.ones(8, 2), atol=2e-2)


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="valid:"):
        linear_mods(torch.randn(4, 32), torch.randn(256, 32), mode="fast")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("mode", sorted(m for m, f in FORWARD_MODES.items() if f.triton))
@pytest.mark.parametrize("backward", ["bf16", "scaled_mm_rowwise", "scaled_mm_tensorwise"])
def test_every_mode_matches_fp32_reference(mode, backward):
    """The plain-torch paths (CPU) of each forward mode and the fused FP8 dgrad, values and both grads."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(128, 64, generator=g) / 8).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(48, 128, generator=g)
    y = linear_mods(x, w, block=32, mode=mode, dgrad=backward, wgrad=backward)
    y.backward(dy.to(torch.bfloat16))
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yr = linear_mods_ref(xr, wr, 32)
    yr.backward(dy)
    tol_y = 0.06 if FORWARD_MODES[mode].fp8 else 0.01
    tol_g = 0.08 if FORWARD_MODES[mode].fp8 or backward != "bf16" else 0.02
    assert _rel(y.detach(), yr.detach()) < tol_y
    assert _rel(x.grad, xr.grad) < tol_g and _rel(w.grad, wr.grad) < tol_g


def test_ragged_batch_falls_back_from_fp8_gemms():
    """M % 16 != 0: torch._scaled_mm cannot run it, so the FP8 dgrad/wgrad run in BF16 (exact to bf16)."""
    x = torch.randn(40, 64).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(128, 64) / 8).to(torch.bfloat16).requires_grad_()
    linear_mods(x, w, block=32, mode="split_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_rowwise").sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    linear_mods(x2, w2, block=32, mode="split_fp8").sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("write_bf16", [True, False])
@pytest.mark.parametrize("granularity,dtype", [("rowwise", torch.float8_e4m3fn), ("tensorwise", torch.float8_e5m2)])
def test_bwd_dz_fp8_op_is_the_quantized_dz(write_bf16, granularity, dtype, fold):
    from loka_trainer.mods.wgrad_fold import fold_dz_ref
    g = torch.Generator().manual_seed(1)
    _, u, r = mods_forward_ref(torch.randn(32, 128, generator=g), 64, 1e-6)
    dh = torch.randn(32, 128, generator=g).to(torch.bfloat16)
    dh[2] = 0.0
    sx = torch.rand(32, 1, generator=g) + 0.01 if fold else None
    q, s, dz, dzt, s_dzt = mods_bwd_dz_fp8(dh, u, r, 64, write_bf16, granularity, sx)
    dz_ref = mods_backward_ref(dh, u, r, 64)
    qr, sr = quantize(dz_ref, granularity, dtype)
    assert q.dtype == dtype and s.shape == sr.shape
    torch.testing.assert_close(s, sr)
    torch.testing.assert_close(q.float(), qr.float())
    assert (q[2].float() == 0).all() and torch.isfinite(s).all()
    assert dz.shape == ((32, 128) if write_bf16 else (0, 128))
    if write_bf16:
        torch.testing.assert_close(dz, dz_ref)
    if fold:  # the folded weight grad's dz operand, (dz·sx)ᵀ e5m2
        dzt_r, s_r = fold_dz_ref(dz_ref, sx)
        torch.testing.assert_close(s_dzt, s_r)
        torch.testing.assert_close(dzt.float(), dzt_r.float())
    else:
        assert dzt.shape == (0, 32) and s_dzt.shape == (0,)
    torch.library.opcheck(mods_bwd_dz_fp8, (dh, u, r, 64, write_bf16, granularity, sx))  # fake impl agrees


def test_bwd_dz_fp8_op_rejects_an_unknown_granularity():
    _, u, r = mods_forward_ref(torch.randn(16, 64), 64, 1e-6)
    with pytest.raises(ValueError, match="unknown granularity 'colwise'"):
        mods_bwd_dz_fp8(torch.randn(16, 64).to(torch.bfloat16), u, r, 64, True, "colwise")


@pytest.mark.parametrize("write_fp8,save", [(False, True), (True, True), (False, False), (True, False)])
def test_mods_fwd_writes_only_what_is_asked(write_fp8, save):
    from loka_trainer.mods.ops import mods_fwd
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 64, generator=g) / 8).to(torch.bfloat16)
    h, u, r, q = mods_fwd(x, w, None, None, 64, 1e-6, True, write_fp8, save)
    full_h, full_u, full_r, _ = mods_fwd(x, w, None, None, 64, 1e-6, True)
    torch.testing.assert_close(h, full_h)  # what is written does not depend on what else is
    assert (u.shape, r.shape) == (((32, 128), (32, 2)) if save else ((0, 128), (0, 2)))
    assert q.shape == ((32, 128) if write_fp8 else (0, 128))
    torch.library.opcheck(mods_fwd, (x, w, None, None, 64, 1e-6, True, write_fp8, save))


@pytest.mark.parametrize("fp8", [False, True])
def test_mods_fwd_keeps_z_for_the_backward_when_asked(fp8):
    from loka_trainer.kernels.quant import quantize_rowwise
    from loka_trainer.mods.ops import mods_bwd_dz, mods_fwd
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 64, generator=g) / 8).to(torch.bfloat16)
    (x, sx), (w, sw) = ((quantize_rowwise(t, torch.float8_e4m3fn) for t in (x, w)) if fp8
                        else ((x, None), (w, None)))
    h, u, r, _ = mods_fwd(x, w, sx, sw, 64, 1e-6, True)
    hz, z, rz, _ = mods_fwd(x, w, sx, sw, 64, 1e-6, True, save_z=True)
    torch.testing.assert_close(h, hz)
    torch.testing.assert_close(r, rz)
    scales = (sx, sw) if fp8 else (None, None)  # z before the scales
    zf = x.float() @ w.float().t()
    assert float((z.float() - zf).norm() / zf.norm()) < 1e-2
    dh = torch.randn(32, 128, generator=g).to(torch.bfloat16)
    dz_u, dz_z = mods_bwd_dz(dh, u, r, 64), mods_bwd_dz(dh, z, r, 64, True, *scales)
    assert float((dz_z.float() - dz_u.float()).norm() / dz_u.float().norm()) < 1e-2
    torch.library.opcheck(mods_bwd_dz, (dh, z, r, 64, True, *scales))


def test_inference_skips_the_autograd_function(monkeypatch):
    from loka_trainer.mods import ops as mods_ops
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 64, generator=g) / 8).to(torch.bfloat16).requires_grad_()
    y_train = mods_ops.linear_mods(x, w, block=64, mode="split_bf16")
    applied = []
    monkeypatch.setattr(mods_ops.LinearModsFn, "apply", lambda *a: applied.append(1) or pytest.fail("saved"))
    with torch.no_grad():
        y_infer = mods_ops.linear_mods(x, w, block=64, mode="split_bf16")
    assert not applied and not y_infer.requires_grad
    torch.testing.assert_close(y_infer, y_train.detach())


def test_backward_makes_no_zero_gradient_for_the_fp8_output():
    """q (the FP8 copy for the next layer) gets no gradient; autograd must not build a zero e4m3 one for it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from loka_trainer.mods.ops import linear_mods_fp8_out

    class Fp8Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.ops += [str(func) for t in outs if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn]
            return out
    x = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(128, 64) / 8).to(torch.bfloat16).requires_grad_()
    h, q = linear_mods_fp8_out(x, w, block=64, mode="split_bf16", emit_fp8=True)
    assert q is not None and q.dtype == torch.float8_e4m3fn and q.shape == (32, 128)
    with Fp8Outputs() as seen:
        h.float().square().sum().backward()
    assert seen.ops == [] and x.grad is not None and w.grad is not None  # BF16 backward: nothing in FP8


def test_side_by_side_off_cuda_runs_both_in_order_and_skips_missing_ones():
    from loka_trainer.mods.streams import side_by_side
    calls = []
    main = lambda: calls.append("main") or torch.ones(2)  # noqa: E731
    side = lambda: calls.append("side") or torch.zeros(2)  # noqa: E731
    a, b = side_by_side(main, side, torch.device("cpu"))
    assert calls == ["main", "side"] and torch.equal(a, torch.ones(2)) and torch.equal(b, torch.zeros(2))
    assert side_by_side(None, side, torch.device("cpu"))[0] is None
    assert side_by_side(main, None, torch.device("cpu"))[1] is None


@pytest.mark.parametrize("streams", [True, False])
def test_the_layers_kernel_config_reaches_its_backward(monkeypatch, streams):
    from loka_trainer.mods import ops
    from loka_trainer.mods.config import ModsKernelConfig
    from loka_trainer.mods.module import FusedLinearMods
    seen = []
    real = ops.side_by_side
    monkeypatch.setattr(ops, "side_by_side", lambda *a, concurrent: seen.append(concurrent) or real(*a))
    layer = FusedLinearMods(64, 128, block_size=64, config=ModsKernelConfig(backward_streams=streams))
    x = torch.randn(32, 64, requires_grad=True)
    ops.linear_mods(x, layer.weight, block=64, config=layer.config).sum().backward()
    assert seen == [streams] and x.grad is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.config.backward_streams = not streams
