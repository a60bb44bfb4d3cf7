"""The folded FP8 weight grad (``wgrad_fold``) on CPU: its error against the tensorwise backend's, and what the
layer keeps for it. The Triton kernels' cases run under the interpreter in test_mods_fp8_interp.py."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.kernels.backends import get_backend
from loka_trainer.kernels.quant import quantize_rowwise
from loka_trainer.mods.ops import linear_mods
from loka_trainer.mods.reference import linear_mods_ref
from loka_trainer.mods.wgrad_fold import wgrad_fold
from tests.kernels.sm90 import SM90_SHARED_BYTES, compile_sm90

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


def _fold_kernels():
    pytest.importorskip("triton")
    from loka_trainer.mods import triton_mods_kernels as mk, triton_wgrad_fold_kernels as fk
    from loka_trainer.mods.triton_mods import FOLD_ROWS
    from loka_trainer.mods.wgrad_fold import BLOCK_C, BLOCK_R
    f32, bf16, e4, e5 = "*fp32", "*bf16", "*fp8e4nv", "*fp8e5"
    tiles = dict(BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, PDL=True)
    dz_types = dict(dy_ptr=bf16, u_ptr=bf16, r_ptr=f32, zs_row_ptr=f32, zs_col_ptr=f32, dz_ptr=bf16, amax_ptr=f32,
                    sx_ptr=f32, fold_amax_ptr=f32)
    dz_consts = dict(TILE_MAXIMA=True, PDL=True, BLOCK_N=256, BLOCK_M=16)
    return {
        "fold_amax": (fk.fold_amax_kernel, dict(dz_ptr=bf16, sx_ptr=f32, amax_ptr=f32), tiles, 4),
        "fold_transpose": (fk.fold_transpose_kernel,
                           dict(dz_ptr=bf16, sx_ptr=f32, amax_ptr=f32, dzt_ptr=e5, s_ptr=f32, xq_ptr=e4, xqt_ptr=e4),
                           dict(FP8_MAX=57344.0, EPS_=1e-12, **tiles), 4),
        "dz_with_fold_amax": (mk.bwd_dz_kernel, dz_types,
                              dict(AMAX=1, FOLD=True, **dz_consts, FROM_Z=False, Z_SCALES=False), 4),
        "dz_with_tensorwise_amax": (mk.bwd_dz_kernel, dz_types,
                                    dict(AMAX=2, FOLD=True, **dz_consts, FROM_Z=False, Z_SCALES=False), 4),
        "dz_from_scaled_z": (mk.bwd_dz_kernel, dz_types,
                             dict(AMAX=1, FOLD=True, **dz_consts, FROM_Z=True, Z_SCALES=True), 4),
        "rowwise_cast_with_fold": (mk.quant_rows_kernel,
                                   dict(dz_ptr=bf16, amax_ptr=f32, q_ptr=e4, s_ptr=f32, sx_ptr=f32,
                                        fold_amax_ptr=f32, qt_ptr=e5, st_ptr=f32),
                                   dict(FP8_MAX_=448.0, EPS_=1e-12, NB_P2=8, FOLD=True, FOLD_FP8_MAX=57344.0,
                                        PDL=True, BLOCK_N=256, BLOCK_M=FOLD_ROWS), 8),
    }


@pytest.mark.parametrize("name", ["fold_amax", "fold_transpose", "dz_with_fold_amax", "dz_with_tensorwise_amax",
                                  "dz_from_scaled_z", "rowwise_cast_with_fold"])
def test_fold_kernels_compile_for_sm90_without_spills_and_wait_for_the_previous_grid(name):
    kernel, types, consts, num_warps = _fold_kernels()[name]
    compiled = compile_sm90(kernel, types, consts, num_warps=num_warps, divisible=True)
    ptx = compiled.asm["ptx"]
    assert "ld.local" not in ptx and "st.local" not in ptx  # no register spills
    assert ("atom." in ptx) == (name == "fold_amax")  # the dz kernel stores its tile maxima: no atomics
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")  # PDL: no load before the previous grid ends
    # the transposed fp8 writes go out 16 bytes per store, not byte by byte (only the scalar scales are 4-byte)
    assert "st.global.b8" not in ptx and "st.global.b16" not in ptx
    assert compiled.metadata.shared <= SM90_SHARED_BYTES


def test_fold_ops_agree_with_their_fake_impls_and_each_other():
    from loka_trainer.mods.wgrad_fold import fold_dz_ref, wgrad_folded_dz
    g = torch.Generator().manual_seed(2)
    dz = torch.randn(M, N, generator=g).to(torch.bfloat16)
    xq, sx = quantize_rowwise(torch.randn(M, K, generator=g), torch.float8_e4m3fn)
    dzt, s = fold_dz_ref(dz, sx)
    assert torch.equal(wgrad_folded_dz(dzt, s, xq), wgrad_fold(dz, xq, sx))  # the same GEMM on the same operands
    # the fake impls agree (what torch.compile traces with); opcheck's schema test cannot handle fp8 inputs on CPU
    checks = ("test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(wgrad_fold, (dz, xq, sx), test_utils=checks)
    torch.library.opcheck(wgrad_folded_dz, (dzt, s, xq), test_utils=checks)
