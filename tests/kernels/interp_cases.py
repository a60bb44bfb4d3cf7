"""Triton-interpreter cases (fused quantizer, fused Mods kernels) vs plain torch.

Not collected by the normal run: ``test_triton_interpreter.py`` runs this file in a fresh process with
TRITON_INTERPRET=1 set before triton is imported (see there why).
"""
from __future__ import annotations

import pytest
import torch

from loka_trainer.kernels.quant import quantize, quantize_rowwise, quantize_tensorwise
from loka_trainer.kernels.triton_env import use_triton
from loka_trainer.kernels.triton_quant import quantize_rowwise_fused
from loka_trainer.kernels.triton_quant_tensorwise import quantize_tensorwise_fused
from loka_trainer.mods import triton_mods
from loka_trainer.mods.ops import linear_mods, mods_backward_ref, mods_forward_ref
from loka_trainer.mods.reference import linear_mods_ref, static_fp8_scale, u_from_z
from tests.kernels.triton_interp import interpret, needs_triton  # noqa: F401  (fixture)


@needs_triton
@pytest.mark.parametrize("shape, transposed", [((37, 100), False), ((8, 1100), False),  # row-major: one pass
                                               ((3, 8300), False),  # rows > SINGLE_PASS_MAX_COLS: two passes
                                               ((37, 100), True), ((8, 1100), True)])  # transposed views
def test_fused_rowwise_matches_reference(interpret, shape, transposed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3
    x[1] = 0.0  # all-zero row: finite scale, exact zeros
    t = x.t() if transposed else x
    assert use_triton(t)
    q, s = quantize_rowwise_fused(t)
    qr, sr = quantize_rowwise(t, torch.float8_e4m3fn)
    assert q.shape == t.shape and q.is_contiguous() and s.shape == (t.shape[0], 1)
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    assert torch.isfinite(s).all() and (q[1 if not transposed else slice(None)].float() == 0).any()
    # NOTE: the interpreter's numpy fp8 cast rounds some values that carry into the next binade differently
    # from torch/GPU (GPU tests check < 0.1%); most elements must still agree exactly.
    assert (q.float() == qr.float()).float().mean() > 0.9


@needs_triton
@pytest.mark.parametrize("shape, transposed", [((37, 300), False), ((300, 37), True)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_tensorwise_matches_reference(interpret, shape, transposed, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    x[3, 5] = 900.0  # one outlier sets the scale; tiles without it must still see it
    t = x.t() if transposed else x
    assert use_triton(t)
    q, s = quantize_tensorwise_fused(t, dtype)
    qr, sr = quantize_tensorwise(t, dtype)
    assert q.shape == t.shape and q.dtype == dtype and q.is_contiguous() and s.shape == ()
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    assert (q.float() == qr.float()).float().mean() > 0.9  # see the rowwise case on the interpreter's cast
    zq, zs = quantize_tensorwise_fused(torch.zeros_like(t), dtype)  # all zeros: finite scale, exact zeros
    assert torch.isfinite(zs) and not zq.float().any()


@needs_triton
@pytest.mark.parametrize("granularity", ["block1x128", "block128x128"])
@pytest.mark.parametrize("transposed", [False, True])
def test_fused_block_quantizers_match_reference(interpret, granularity, transposed):
    from loka_trainer.kernels.triton_gemm import quantize_128x128, quantize_1x128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=g)  # neither dim a multiple of 128: ragged edge tiles
    x[:, 128:256] = 0.0  # an all-zero group / tile: finite scale, exact zeros
    x[150, 10] = 700.0  # an outlier that sets one tile's scale only
    t = x.t() if transposed else x
    q, s = (quantize_1x128 if granularity == "block1x128" else quantize_128x128)(t)
    qr, sr = quantize(t, granularity)
    assert q.shape == t.shape and q.is_contiguous() and s.shape == sr.shape
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    assert torch.isfinite(s).all() and (q.float() == qr.float()).float().mean() > 0.9


M, K, N, B = 40, 32, 64, 32  # M not a multiple of any row tile: masked edge rows are exercised


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _xw(dtype):
    g = torch.Generator().manual_seed(0)
    return torch.randn(M, K, generator=g).to(dtype), (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: tl.dot widened (patch_interpreter)
def test_fused_forward_matches_reference(interpret, dtype):
    x, w = _xw(dtype)
    h, u, r, q = triton_mods.fused_forward(x, w, block=B, write_fp8=True)
    hr, ur, rr = mods_forward_ref(x.float() @ w.float().t(), B, 1e-6)
    assert _rel(h, hr) < 1e-2 and _rel(u, ur) < 1e-2
    torch.testing.assert_close(r, rr, rtol=1e-4, atol=0)
    assert r.shape == (M, N // B) and float(h.float().abs().max()) <= B ** 0.5
    assert _rel(q.float() / static_fp8_scale(B), hr) < 0.1  # static-scale FP8 epilogue


@needs_triton
def test_norm_forward_and_backward_dz_match_reference(interpret):
    x, w = _xw(torch.float32)
    z = (x @ w.t()).to(torch.bfloat16)
    h, u, r, _ = triton_mods.norm_forward(z, block=B)
    hr, ur, rr = mods_forward_ref(z.float(), B, 1e-6)
    assert _rel(h, hr) < 1e-2
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    dz = triton_mods.backward_dz(dy, u, r, block=B)
    assert dz.dtype == torch.bfloat16 and _rel(dz, mods_backward_ref(dy, u, r, B)) < 1e-2


@needs_triton
def test_norm_forward_adds_k_slice_partials(interpret):
    x, w = _xw(torch.float32)
    parts = triton_mods.cublas_split_k(x, w, 4)  # (4, M, N) fp32
    h, u, r, _ = triton_mods.norm_forward(parts, block=B)
    hr, ur, rr = mods_forward_ref(x @ w.t(), B, 1e-6)
    assert _rel(h, hr) < 1e-2 and _rel(u, ur) < 1e-2
    torch.testing.assert_close(r, rr, rtol=1e-4, atol=0)


@needs_triton
@pytest.mark.parametrize("splits", [1, 4])  # z from one GEMM, or the sum of K-slice partials
def test_norm_forward_can_keep_z_for_a_backward_that_recomputes_u(interpret, splits):
    x, w = _xw(torch.float32)
    z = triton_mods.cublas_split_k(x, w, 4) if splits > 1 else (x @ w.t()).to(torch.bfloat16)
    h, u, r, _ = triton_mods.norm_forward(z, block=B)
    hz, kept, rz, _ = triton_mods.norm_forward(z, block=B, save_z=True)
    assert torch.equal(h, hz) and torch.equal(r, rz)  # the forward's results do not depend on what is kept
    if splits == 1:
        assert kept is z  # z itself: no (M, N) write
    else:
        assert kept.dtype == torch.bfloat16 and _rel(kept, z.sum(0)) < 1e-2
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    dz_u = triton_mods.backward_dz(dy, u, r, block=B)
    dz_z = triton_mods.backward_dz(dy, kept, r, block=B, from_z=True)
    assert _rel(dz_z, dz_u) < 1e-2 and _rel(dz_z, mods_backward_ref(dy, u_from_z(kept, r, B), r, B)) < 1e-2


@needs_triton
def test_backward_dz_from_a_unit_scale_gemms_z_applies_the_scales(interpret):
    x, w = _xw(torch.float32)
    g = torch.Generator().manual_seed(3)
    row, col = torch.logspace(-1, 1, M)[:, None], torch.rand(N, 1, generator=g) + 0.5
    z = (x @ w.t()).to(torch.bfloat16)
    _, kept, r, _ = triton_mods.norm_forward(z, block=B, row_scale=row, col_scale=col, save_z=True)
    _, u, r_u, _ = triton_mods.norm_forward(z, block=B, row_scale=row, col_scale=col)
    assert kept is z and torch.equal(r, r_u)
    dy = torch.randn(M, N, generator=g).to(torch.bfloat16)
    dz = triton_mods.backward_dz(dy, kept, r, block=B, from_z=True, z_row_scale=row, z_col_scale=col)
    assert _rel(dz, triton_mods.backward_dz(dy, u, r, block=B)) < 1e-2
    assert _rel(dz, triton_mods.backward_dz(dy, kept, r, block=B, from_z=True)) > 0.1  # the scales matter here


@needs_triton
def test_linear_mods_split_autograd_matches_reference(interpret):
    x, w = _xw(torch.bfloat16)
    x.requires_grad_(), w.requires_grad_()
    dy = torch.randn(M, N, generator=torch.Generator().manual_seed(2))
    y = linear_mods(x, w, block=B, mode="split_bf16")
    y.backward(dy.to(torch.bfloat16))
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    linear_mods_ref(xr, wr, B).backward(dy)
    assert _rel(y.detach(), linear_mods_ref(xr, wr, B).detach()) < 1e-2
    assert _rel(x.grad, xr.grad) < 2e-2 and _rel(w.grad, wr.grad) < 2e-2


@needs_triton
@pytest.mark.parametrize("split", [False, True])
def test_forward_without_saving_writes_the_same_output(interpret, split):
    x, w = _xw(torch.float32)
    run = ((lambda **kw: triton_mods.norm_forward((x @ w.t()).to(torch.bfloat16), block=B, **kw)) if split
           else (lambda **kw: triton_mods.fused_forward(x, w, block=B, **kw)))
    h, u, r, q = run(write_fp8=True, save=True)
    h2, u2, r2, q2 = run(write_fp8=True, save=False)
    assert u2 is None and r2 is None and u is not None and r is not None
    torch.testing.assert_close(h2, h)
    assert torch.equal(q2.float(), q.float())


@needs_triton
@pytest.mark.parametrize("split_k", [2, 3])  # 3: K's 4 tiles split 2 + 2 + 0 (an empty slice stores zeros)
@pytest.mark.parametrize("scaled", [False, True])
def test_split_k_forward_matches_one_slice(interpret, split_k, scaled):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(M, 128, generator=g), torch.randn(N, 128, generator=g) / 128 ** 0.5
    scales = dict(x_scale_inv=torch.rand(M, 1, generator=g) + 0.5, w_scale_inv=torch.rand(N, 1, generator=g) + 0.5)
    kw = dict(block=B, write_fp8=True, **(scales if scaled else {}))
    h, u, r, q = triton_mods.fused_forward(x, w, split_k=split_k, **kw)
    h1, u1, r1, q1 = triton_mods.fused_forward(x, w, split_k=1, **kw)
    z = (x * scales["x_scale_inv"]) @ (w * scales["w_scale_inv"]).t() if scaled else x @ w.t()
    hr, _, rr = mods_forward_ref(z, B, 1e-6)
    assert _rel(h, hr) < 1e-2 and _rel(h, h1) < 1e-2 and _rel(u, u1) < 1e-2
    torch.testing.assert_close(r, rr, rtol=1e-4, atol=0)
    assert (q.float() == q1.float()).float().mean() > 0.9


@needs_triton
@pytest.mark.parametrize("M, K, N", [(40, 32, 64), (70, 48, 40)])  # ragged row, K and N tiles
def test_grouped_grads_match_torch(interpret, M, K, N):
    from loka_trainer.mods import triton_grads
    g = torch.Generator().manual_seed(3)
    dz, x, w = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((M, N), (M, K), (N, K)))
    dx, dw = triton_grads.grads(dz, x, w)
    assert dx.shape == (M, K) and dw.shape == (N, K) and dx.dtype == dw.dtype == torch.bfloat16
    assert _rel(dx, dz.float() @ w.float()) < 1e-2 and _rel(dw, dz.float().t() @ x.float()) < 1e-2


@needs_triton
@pytest.mark.parametrize("dgrad, expected_calls", [("bf16", 1), ("scaled_mm_rowwise", 0)])
def test_layer_backward_routes_small_bf16_grads_to_one_launch(interpret, monkeypatch, dgrad, expected_calls):
    from loka_trainer.mods import triton_grads
    calls = []
    grads = triton_grads.grads
    monkeypatch.setattr(triton_grads, "grads", lambda *a, **k: calls.append(1) or grads(*a, **k))
    g = torch.Generator().manual_seed(4)
    rows = 48  # a multiple of 16, so the FP8 dgrad backend runs (on ragged batches it falls back to BF16)
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(rows, N, generator=g)
    linear_mods(x, w, block=B, mode="split_bf16", dgrad=dgrad).backward(dy.to(torch.bfloat16))
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    linear_mods_ref(xr, wr, B).backward(dy)
    assert len(calls) == expected_calls
    tol = 0.08 if dgrad != "bf16" else 2e-2
    assert _rel(x.grad, xr.grad) < tol and _rel(w.grad, wr.grad) < 2e-2


@needs_triton
def test_every_float_a_kernel_takes_is_a_constexpr(interpret, monkeypatch):
    """Inductor types a float argument of a user-defined Triton kernel fp64 where eager Triton types it fp32, and
    fp64 spreads through the kernel's math: under torch.compile the Mods epilogue ran 16.3 µs slower at (256, 7680)
    on the H200 (docs/results.md §3). So every float our kernels get is a constexpr: launch the layer in modes that
    reach every kernel of the fused Mods layer and its quantizers, and list any float passed to another parameter."""
    import inspect

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    run, launched, runtime_floats = InterpretedFunction.run, set(), set()

    def checked(self, *args, **kwargs):
        params = inspect.signature(self.fn).parameters
        launched.add(self.fn.__name__)
        for name, value in [*zip(params, args), *kwargs.items()]:
            if isinstance(value, float) and name in params and params[name].annotation is not tl.constexpr:
                runtime_floats.add((self.fn.__name__, name))
        return run(self, *args, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", checked)
    g = torch.Generator().manual_seed(0)
    rows = 48  # a multiple of 16: torch._scaled_mm takes it, so the FP8 backward paths run too
    x, w = torch.randn(rows, K, generator=g).to(torch.bfloat16), (torch.randn(N, K, generator=g) / K ** 0.5).to(
        torch.bfloat16)
    dy = torch.randn(rows, N, generator=g).to(torch.bfloat16)
    for kernels in (dict(mode="split_bf16"), dict(mode="fused_bf16", wgrad="scaled_mm_tensorwise"),
                    dict(mode="split_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_tensorwise"),
                    dict(mode="fused_fp8", dgrad="scaled_mm_tensorwise")):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        linear_mods(xg, wg, block=B, **kernels).backward(dy)
    triton_mods.norm_forward(torch.randn(2, M, N).contiguous(), block=B)  # the split-K partials' epilogue
    assert {"fused_fwd_kernel", "norm_fwd_kernel", "bwd_dz_kernel", "quant_rowwise_kernel", "quant_rows_kernel",
            "amax_kernel", "cast_kernel"} <= launched, launched
    assert runtime_floats == set()


@needs_triton
@pytest.mark.parametrize("transposed", [False, True])
def test_every_tile_the_quant_sweep_tries_quantizes_like_the_shipped_one(interpret, transposed):
    # benchmarks/sweep_quant_tiles ranks tiles of quant_rowwise_kernel; any of them may become the shipped one
    from benchmarks.sweep_quant_tiles import candidate_tiles, launch_tile
    # row-major 1100 wide: one-pass tiles and two-pass 512/1024-wide chunks; transposed: one pass and 16-128 rows
    x = torch.randn(*((40, 72) if transposed else (24, 1100)), generator=torch.Generator().manual_seed(0)) * 3
    x[3] = 0.0
    t = x.t() if transposed else x
    R, C = t.shape
    q_ref, s_ref = quantize_rowwise_fused(t)
    # the interpreter ignores warps: one launch per (rows, cols, passes)
    tiles = {tile[:3]: tile for tile in candidate_tiles(R, C, not transposed)}.values()
    assert len(tiles) > 8
    for tile in tiles:
        q, s = torch.zeros(R, C, dtype=torch.float8_e4m3fn), torch.empty(R, 1)
        launch_tile(t, q, s, tile)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref), tile
