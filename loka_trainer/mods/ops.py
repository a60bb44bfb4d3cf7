"""The fused Mods layer as torch ``triton_op``s + one autograd function (forward and backward fused).

Notation: M rows, K in-features, N out-features, B the BlockNorm block, NB = N / B.

Ops (``torch.library.triton_op``: eager, one op call each; compiled, inductor traces the body and launches its
Triton kernels from its own generated code, no Python of ours per call; each has a plain-torch path used
off-Triton, e.g. on CPU, with identical outputs up to rounding):

- ``loka::quant_rowwise`` (``triton_quant``): rowwise e4m3 quantization in one fused Triton kernel.
- ``loka::mods_fwd(x, w, sx?, sw?, block, eps, split, write_fp8) -> (h, u, r, q)``: GEMM -> BlockNorm ->
  HardSwish (``split``: cuBLAS GEMM — ``torch._scaled_mm`` for e4m3 inputs, tensorwise with unit scales and the
  rowwise scales applied by the epilogue (``FP8_FORWARD_FAST_ACCUM`` says why); a bf16 one split over K where few
  output tiles meet a long K, ``triton_mods.cublas_split_k`` — + one Triton epilogue kernel
  instead of the single fused kernel; q: the output also in FP8 at the static scale, for the next layer).
- ``loka::mods_bwd_dz(dh, u, r, block, from_z?, z_row_scale?, z_col_scale?) -> dz``: HardSwish' and BlockNorm
  backward in one pass (u recomputed from z where the split forward kept z instead).
- ``loka::grads_bf16(dz, x, w) -> (dx, dW)``: dx = dz·W and dW = dzᵀ·x in one Triton launch (small N·K).
- ``loka::mods_bwd_dz_fp8(dh, u, r, block, write_bf16, granularity, fold_sx?) -> (dz_q, scale_inv, dz, dzt,
  s_dzt)`` (``mods.ops_fp8``): the same dz quantized for an FP8 dgrad (rowwise e4m3 or tensorwise e5m2): the dz
  kernel also writes the amaxes, one cast kernel follows; with ``fold_sx`` also the folded weight grad's dz operand.
- ``loka::wgrad_fold(dz, xq, sx, fast_accum) -> dW`` (``wgrad_fold``): a tensorwise FP8 weight grad reading the
  forward's FP8 x; ``loka::wgrad_folded_dz(dzt, s, xq, fast_accum) -> dW`` the same with its dz operand written by
  ``mods_bwd_dz_fp8``.

``LinearModsFn``: forward = (quant_rowwise on x if FP8, unless the previous layer handed x over in FP8) +
mods_fwd, saving x (or, for a folded weight grad, the FP8 x), w, u (bf16; in the split modes z instead, and the
FP8 GEMM's row and column scales) and r (fp32);
backward = dz then dx = dz·W and dW = dzᵀ·x on the backends the Dispatch plan chose (bf16 -> cuBLAS
directly), the two GEMMs on two CUDA streams (``streams.side_by_side``), or, for a small all-BF16 layer, in one
launch (``loka::grads_bf16``, ``triton_grads``). Forward modes: ``mods.modes.FORWARD_MODES``.

FP8 backward (``mods.ops_fp8``): an FP8 dgrad runs fused with the dz kernels (``FUSED_DGRAD``, the backend's
numerics exactly), a tensorwise FP8 weight grad behind an FP8 forward runs folded (``FOLDED_WGRAD``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from loka_trainer.kernels.backends import BASELINE, get_backend
from loka_trainer.kernels.backends_scaled_mm import scaled_mm_nt
from loka_trainer.kernels.linear import WeightCache
from loka_trainer.kernels.triton_env import use_triton
from loka_trainer.kernels.triton_quant import quant_rowwise
from loka_trainer.mods import shapes, triton_grads, triton_mods
from loka_trainer.mods.config import DEFAULT_KERNEL_CONFIG, ModsKernelConfig
from loka_trainer.mods.modes import DEFAULT_FORWARD_MODE, FORWARD_MODES
from loka_trainer.mods.ops_fp8 import FOLDED_WGRAD, FUSED_DGRAD
from loka_trainer.mods.reference import (
    block_norm, hard_swish, mods_backward_ref, mods_forward_ref, quantize_static, static_fp8_scale, u_from_z,
)
from loka_trainer.mods.streams import side_by_side
from loka_trainer.mods.wgrad_fold import unit_scale, wgrad_fold, wgrad_folded_dz

FP8_WEIGHT_BACKEND = "scaled_mm_rowwise"  # its cached rowwise e4m3 weights are what the FP8 paths read
# The split FP8 forward's GEMM is cuBLASLt's tensorwise FP8 GEMM with unit scales; the epilogue kernel applies x's
# and W's rowwise scales (z = sx·(xq·wqᵀ)·sw, one bf16 rounding). On the H200 it took the split FP8 layer from
# 1.56x to 1.65x geomean over the rowwise-scaled GEMM (faster at 6 of 9 figure-13 shapes by up to 10.7 µs, within
# 1.2 µs at the other 3; docs/kernels/README.md "Forward: four modes"). It runs on the fast-accumulation kernel,
# as torchao runs its forward GEMM: never more than 0.03 µs slower, up to 1.3x faster, output within 3e-3 of exact
# accumulation ("Fast accumulation" there). The split modes' backward reads z (the GEMM's output, in memory anyway)
# instead of u: one (M, N) tensor fewer to write, faster at all 9 shapes for split_fp8_dgrad ("Keep z" there).
FP8_FORWARD_FAST_ACCUM = True
FP8_MULTIPLE = 16  # torch._scaled_mm needs every dim of both operands divisible by 16


@triton_op("loka::mods_fwd", mutates_args=())
def mods_fwd(x: Tensor, w: Tensor, sx: Optional[Tensor], sw: Optional[Tensor], block: int, eps: float,
             split: bool, write_fp8: bool = False, save: bool = True, save_z: bool = False
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (M, K), w (N, K) bf16 (or e4m3 with sx (M, 1), sw (N, 1)) -> (h, u, r, q); see module docstring.

    q (M, N) e4m3 = h at the static scale ``mods.reference.static_fp8_scale(block)`` (the next layer's FP8 input,
    written by the same epilogue) when ``write_fp8``; u, r only when ``save`` (the backward's inputs;
    inference skips writing them). What is not written comes back as an empty (0, ...) tensor (ops cannot
    return None). ``split`` and ``save_z``: the second output is z = x·Wᵀ (M, N) bf16 instead of u (the
    GEMM's output, kept: no u to write), before the scales sx, sw.
    """
    N = w.shape[0]
    save_z = save_z and split and save
    if use_triton(x) and shapes.supports(x.shape[1], N, block):
        if split:
            k_slices = triton_mods.cublas_split_k_for(x, N, block) if sx is None else 1
            if k_slices > 1:  # (k_slices, M, N) fp32 partials; the epilogue kernel adds them
                z = triton_mods.cublas_split_k(x, w, k_slices)
            elif sx is not None:  # the rowwise scales applied by the epilogue kernel
                one = unit_scale(x)
                z = scaled_mm_nt(x, one, w, one, FP8_FORWARD_FAST_ACCUM)  # (M, N) bf16 of the e4m3 products
            else:  # (M, N) bf16
                z = x @ w.t()
            h, u, r, q = triton_mods.norm_forward(z, block=block, eps=eps, write_fp8=write_fp8, save=save,
                                                  row_scale=sx, col_scale=sw, save_z=save_z)
        else:
            h, u, r, q = triton_mods.fused_forward(x, w, x_scale_inv=sx, w_scale_inv=sw, block=block, eps=eps,
                                                   write_fp8=write_fp8, save=save)
    else:
        xf = x.float() if sx is None else x.float() * sx.reshape(-1, 1)
        wf = w.float() if sw is None else w.float() * sw.reshape(-1, 1)
        z = xf @ wf.t()
        h, u, r = mods_forward_ref(z, block, eps)
        if save_z:  # z as the Triton path keeps it: before the scales of the unit-scale FP8 GEMM
            u = (x.float() @ w.float().t() if sx is not None else z).to(torch.bfloat16)
        q = quantize_static(h, block)[0] if write_fp8 else None
        u, r = (u, r) if save else (None, None)
    empty = lambda *shape, dtype: x.new_empty(shape, dtype=dtype)  # noqa: E731
    return (h, u if u is not None else empty(0, N, dtype=torch.bfloat16),
            r if r is not None else empty(0, N // block, dtype=torch.float32),
            q if q is not None else empty(0, N, dtype=torch.float8_e4m3fn))


@triton_op("loka::mods_bwd_dz", mutates_args=())
def mods_bwd_dz(dh: Tensor, u: Tensor, r: Tensor, block: int, from_z: bool = False,
                z_row_scale: Optional[Tensor] = None, z_col_scale: Optional[Tensor] = None) -> Tensor:
    """dh (M, N), u (M, N) bf16, r (M, NB) fp32 -> dz (M, N) bf16. ``from_z``: u holds z (``mods_fwd(save_z=)``),
    times z_row_scale (M, 1) and z_col_scale (N, 1) when given (``triton_mods.backward_dz``)."""
    if use_triton(dh):
        return triton_mods.backward_dz(dh, u, r, block=block, from_z=from_z, z_row_scale=z_row_scale,
                                       z_col_scale=z_col_scale)
    return mods_backward_ref(dh, u_from_z(u, r, block, z_row_scale, z_col_scale) if from_z else u, r, block)


@triton_op("loka::grads_bf16", mutates_args=())
def grads_bf16(dz: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """dz (M, N), x (M, K), w (N, K) bf16 -> (dx = dz·W (M, K), dW = dzᵀ·x (N, K)) bf16, one Triton launch
    (``triton_grads``) or two GEMMs."""
    if use_triton(dz):
        return triton_grads.grads(dz, x, w)
    return dz @ w, dz.t() @ x


def _weight_grad(name: str, dz: Tensor, x: Tensor) -> Tensor:
    """dz (M, N), x (M, K) -> dW (N, K) on backend ``name`` (bf16: one cuBLAS GEMM, no casts)."""
    if name == BASELINE:
        return dz.t() @ x
    return get_backend(name).weight_grad(dz, x)


def _input_grad(name: str, dz: Tensor, w: Tensor, cache) -> Tensor:
    """dz (M, N), w (N, K) -> dx (M, K) on backend ``name``, its weight operand from ``cache``."""
    if name == BASELINE:
        return dz @ w
    return get_backend(name).input_grad(dz, w, wt_q=cache.get(w, name, "input_grad"))


def _runnable(name: str, M: int, K: int, N: int) -> str:
    """``name``, or BF16 when that backend cannot run this shape (e.g. a ragged last batch, M % 16)."""
    return name if name == BASELINE or get_backend(name).supports(M, K, N) else BASELINE


def _fp8_input(xb: Tensor, x_q: Optional[Tensor], x_q_scale_inv: float) -> tuple[Tensor, Tensor]:
    """xb (M, K) -> (xq (M, K) e4m3, sx (M, 1) fp32): ``x_q`` handed over by the previous layer at the static
    scale ``x_q_scale_inv`` (no quantization pass here), else one ``quant_rowwise`` pass."""
    if x_q is not None:
        return x_q, torch.full((xb.shape[0], 1), x_q_scale_inv, dtype=torch.float32, device=xb.device)
    return quant_rowwise(xb.to(torch.bfloat16))


def _mods_forward(xb: Tensor, wb: Tensor, block: int, eps: float, mode: str, cache, x_q: Optional[Tensor],
                  x_q_scale_inv: float, emit_fp8: bool, *, save: bool, w_for_cache: Optional[Tensor] = None
                  ) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Optional[tuple[Tensor, Tensor]], tuple]:
    """The forward of one Mods layer in ``mode``: xb (M, K), wb (N, K) -> ((h, u, r, q) as ``mods_fwd``, the FP8
    x (xq, sx) of an FP8 forward or None, (from_z, z_row_scale, z_col_scale): what u holds, as ``mods_bwd_dz``
    takes it).

    FP8 forward: x from ``_fp8_input``; W from ``cache`` (keyed by ``w_for_cache``, the parameter itself,
    default wb)."""
    fwd = FORWARD_MODES[mode]
    M = xb.shape[0]
    if not fwd.fp8:
        save_z = save and fwd.split
        return (mods_fwd(xb.to(torch.bfloat16), wb.to(torch.bfloat16), None, None, block, eps, fwd.split,
                         emit_fp8, save, save_z), None, (save_z, None, None))
    xq, sx = _fp8_input(xb, x_q, x_q_scale_inv)
    wq, sw = cache.get(wb if w_for_cache is None else w_for_cache, FP8_WEIGHT_BACKEND, "forward")
    split = fwd.split and M % FP8_MULTIPLE == 0  # torch._scaled_mm needs M % 16; the fused kernel has no limit
    save_z = save and split
    z_scales = (sx, sw) if save_z else (None, None)
    return (mods_fwd(xq, wq, sx, sw, block, eps, split, emit_fp8, save, save_z), (xq, sx),
            (save_z, *z_scales))


def _grads_on_backends(ctx, saved: tuple, dh: Tensor, need_dx: bool, need_dw: bool
                       ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``LinearModsFn.backward``'s general case: dh (M, N) -> (dx (M, K) or None, dW (N, K) or None), dz by the dz
    kernel(s), then the two GEMMs on the plan's backends, on two streams (FUSED_DGRAD, FOLDED_WGRAD: module
    docstring). ``saved``: the forward's saved tensors (x or None, xq or None, sx or None, w, u or z, r,
    z_row_scale or None, z_col_scale or None)."""
    xb, xq, sx, wb, u, r, zs_row, zs_col = saved
    z_src = (ctx.from_z, zs_row, zs_col)
    dgrad, wgrad = ctx.names
    folded = None  # the folded weight grad's dz operand, when the dz kernels wrote it
    if need_dx and dgrad in FUSED_DGRAD:
        fold_sx = sx if need_dw and xq is not None else None
        dx_fn, dz, folded = FUSED_DGRAD[dgrad](dh, u, r, ctx.block, wb, ctx.cache, need_dw and fold_sx is None,
                                               fold_sx, z_src)
    else:
        dz = mods_bwd_dz(dh, u, r, ctx.block, *z_src)
        dx_fn = (lambda: _input_grad(dgrad, dz, wb, ctx.cache)) if need_dx else None
    if not need_dw:
        dw_fn = None
    elif folded is not None:
        dw_fn = lambda: wgrad_folded_dz(*folded, xq, FOLDED_WGRAD[wgrad])  # noqa: E731
    elif xq is not None:
        dw_fn = lambda: wgrad_fold(dz, xq, sx, FOLDED_WGRAD[wgrad])  # noqa: E731
    else:
        dw_fn = lambda: _weight_grad(wgrad, dz, xb)  # noqa: E731
    # the two GEMMs on two streams (CUDA, eager) unless the layer's config says in order
    return side_by_side(dx_fn, dw_fn, dh.device, concurrent=ctx.backward_streams)


class LinearModsFn(torch.autograd.Function):
    """(h, q) = HardSwish(BlockNorm(x·Wᵀ)): x (M, K), w (N, K) -> h (M, N) bf16, q (M, N) e4m3 or (0, N).

    ``mode`` a Triton mode of FORWARD_MODES (not ``plain``); ``dgrad``/``wgrad`` backend names (``FUSED_DGRAD``
    ones run fused); ``cache`` a ``linear.WeightCache`` (FP8 weight operands cast once per weight version, i.e.
    per step).
    ``x_q`` (M, K) e4m3 with the scalar ``x_q_scale_inv``: x already in FP8 from the previous Mods layer's
    epilogue (static scale), used instead of quantizing x when the forward is FP8. ``emit_fp8``: also write this
    layer's output in FP8 at the static scale (q, not differentiable; empty otherwise). ``backward_streams``:
    ``ModsKernelConfig.backward_streams`` (a plain bool, a constant for torch.compile).
    """

    @staticmethod
    def forward(ctx, x, w, block: int, eps: float, mode: str, dgrad: str, wgrad: str, cache,
                x_q: Optional[Tensor], x_q_scale_inv: float, emit_fp8: bool, backward_streams: bool = True):
        (M, K), N = x.shape, w.shape[0]
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        (h, u, r, q), x_fp8, (from_z, *z_scales) = _mods_forward(xb, wb, block, eps, mode, cache, x_q,
                                                                 x_q_scale_inv, emit_fp8, save=True, w_for_cache=w)
        ctx.names = (_runnable(dgrad, M, K, N), _runnable(wgrad, M, K, N))
        # the folded FP8 weight grad reads the forward's FP8 x instead of x (not kept then)
        fold = x_fp8 is not None and ctx.names[1] in FOLDED_WGRAD
        ctx.save_for_backward(*((None, *x_fp8) if fold else (xb, None, None)), wb, u, r, *z_scales)
        ctx.from_z = from_z
        ctx.block, ctx.cache, ctx.backward_streams = block, cache, backward_streams
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.mark_non_differentiable(q)
        # q never gets a gradient: without this autograd passes backward a zero-filled (M, N) e4m3 tensor for
        # it (a fill kernel per layer and step: 4-9 us per layer in the H200 MLP-stack profile)
        ctx.set_materialize_grads(False)
        return h, q

    @staticmethod
    def backward(ctx, dh, _dq):
        if dh is None:  # h was not used in the loss
            return (None,) * 12
        saved = ctx.saved_tensors
        xb, _, _, wb, u, r, zs_row, zs_col = saved
        dgrad, wgrad = ctx.names
        need_dx, need_dw = ctx.needs_input_grad[:2]
        M, (N, K) = u.shape[0], wb.shape
        if (need_dx and need_dw and dgrad == wgrad == BASELINE and use_triton(dh)
                and triton_grads.applies(M, K, N)):  # a small BF16 layer: both GEMMs in one launch
            dx, dw = grads_bf16(mods_bwd_dz(dh, u, r, ctx.block, ctx.from_z, zs_row, zs_col), xb, wb)
        else:
            dx, dw = _grads_on_backends(ctx, saved, dh, need_dx, need_dw)
        dx = dx.to(ctx.dtypes[0]) if dx is not None else None
        dw = dw.to(ctx.dtypes[1]) if dw is not None else None
        return dx, dw, None, None, None, None, None, None, None, None, None, None


def linear_mods_fp8_out(x: Tensor, w: Tensor, *, block: int = 256, eps: float = 1e-6,
                        mode: str = DEFAULT_FORWARD_MODE, dgrad: str = "bf16", wgrad: str = "bf16", cache=None,
                        x_fp8: Optional[Tensor] = None, x_fp8_scale_inv: float = 1.0,
                        emit_fp8: bool = False, config: ModsKernelConfig = DEFAULT_KERNEL_CONFIG
                        ) -> tuple[Tensor, Optional[Tensor]]:
    """``linear_mods`` that can take its input already in FP8 and hand its output on in FP8:
    x (M, K) -> (h (M, N) bf16, q (M, N) e4m3 at ``static_fp8_scale(block)`` or None).

    ``x_fp8`` (M, K) e4m3 with scalar ``x_fp8_scale_inv`` (x ≈ x_fp8 · x_fp8_scale_inv) replaces the
    quantization of x when ``mode`` is an FP8 forward (ignored otherwise). ``config``: the layer's
    ``ModsKernelConfig``. Shapes the kernels do not support run the differentiable reference (q is None then).
    """
    if mode not in FORWARD_MODES or not FORWARD_MODES[mode].triton:
        raise ValueError(f"linear_mods mode: {mode!r} is not a kernel mode (``plain`` is FusedLinearMods' PyTorch "
                         f"math); valid: {sorted(m for m, f in FORWARD_MODES.items() if f.triton)}")
    if not shapes.supports(x.shape[-1], w.shape[0], block):
        return hard_swish(block_norm(x.float() @ w.float().t(), block, eps)).to(torch.bfloat16), None
    if cache is None:
        cache = WeightCache()
    if not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):  # inference: nothing to save
        (h, _, _, q), _, _ = _mods_forward(x, w, block, eps, mode, cache, x_fp8, x_fp8_scale_inv, emit_fp8,
                                           save=False)
    else:
        h, q = LinearModsFn.apply(x, w, block, eps, mode, dgrad, wgrad, cache, x_fp8, x_fp8_scale_inv, emit_fp8,
                                  config.backward_streams)
    return h, (q if emit_fp8 else None)


def linear_mods(x: Tensor, w: Tensor, *, block: int = 256, eps: float = 1e-6, mode: str = DEFAULT_FORWARD_MODE,
                dgrad: str = "bf16", wgrad: str = "bf16", cache=None,
                config: ModsKernelConfig = DEFAULT_KERNEL_CONFIG) -> Tensor:
    """HardSwish(BlockNorm(x·Wᵀ)) with fused forward and backward: x (M, K), w (N, K) -> (M, N) bf16.

    Shapes the kernels do not support (N % block, K % 16) run the differentiable reference instead.
    """
    return linear_mods_fp8_out(x, w, block=block, eps=eps, mode=mode, dgrad=dgrad, wgrad=wgrad, cache=cache,
                               config=config)[0]


def static_scale_inv(block: int) -> float:
    """The scale_inv of a Mods layer's FP8 output q: h ≈ q · static_scale_inv(block)."""
    return 1.0 / static_fp8_scale(block)
