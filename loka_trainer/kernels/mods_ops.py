"""The fused Mods layer as torch custom ops + one autograd function (forward and backward fused).

Notation: M rows, K in-features, N out-features, B the BlockNorm block, NB = N / B.

Custom ops (opaque to ``torch.compile``, so Triton kernels run as written inside a compiled region; each
has a plain-torch path used off-Triton, e.g. on CPU, with identical outputs up to rounding):

- ``loka::quant_rowwise`` (``triton_quant``): rowwise e4m3 quantization in one fused Triton kernel.
- ``loka::mods_fwd(x, w, sx?, sw?, block, eps, split) -> (h, u, r)``: GEMM -> BlockNorm -> HardSwish
  (``split``: cuBLAS GEMM + one Triton epilogue kernel instead of the single fused kernel).
- ``loka::mods_bwd_dz(dh, u, r, block) -> dz``: HardSwish' and BlockNorm backward in one pass.

``LinearModsFn``: forward = (quant_rowwise on x if FP8) + mods_fwd, saving x, w, u (bf16) and r (fp32);
backward = mods_bwd_dz then dx = dz·W and dW = dzᵀ·x on the backends the Dispatch plan chose
(bf16 -> cuBLAS directly). Forward modes (``FORWARD_MODES``): ``fused_bf16``, ``split_bf16``, ``fused_fp8``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from loka_trainer.kernels import triton_mods
from loka_trainer.kernels.backends import get_backend
from loka_trainer.kernels.linear import WeightCache
from loka_trainer.kernels.mods_ref import block_norm, hard_swish
from loka_trainer.kernels.triton_quant import quant_rowwise, use_triton

FP8_WEIGHT_BACKEND = "scaled_mm_rowwise"  # its cached rowwise e4m3 weight is what the fused FP8 kernel reads

# forward mode -> (uses FP8 inputs, split GEMM and epilogue)
FORWARD_MODES: dict[str, tuple[bool, bool]] = {
    "fused_bf16": (False, False),
    "split_bf16": (False, True),
    "fused_fp8": (True, False),
}


@torch.no_grad()
def mods_forward_ref(z: Tensor, block: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """z (M, N) fp32 -> (h (M, N) bf16, u (M, N) bf16, r (M, NB) fp32), the kernels' plain-torch twin."""
    zb = z.float().unflatten(-1, (-1, block))  # (M, NB, B)
    r = torch.rsqrt(zb.square().mean(-1) + eps)  # (M, NB)
    u = (zb * r.unsqueeze(-1)).flatten(-2)
    return hard_swish(u).to(torch.bfloat16), u.to(torch.bfloat16), r


@torch.library.custom_op("loka::mods_fwd", mutates_args=())
def mods_fwd(x: Tensor, w: Tensor, sx: Optional[Tensor], sw: Optional[Tensor], block: int, eps: float,
             split: bool) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, K), w (N, K) bf16 (or e4m3 with sx (M, 1), sw (N, 1)) -> (h, u, r); see module docstring."""
    if use_triton(x) and triton_mods.supports(x.shape[1], w.shape[0], block):
        if split and sx is None:
            return triton_mods.norm_forward(x @ w.t(), block=block, eps=eps)[:3]
        return triton_mods.fused_forward(x, w, x_scale_inv=sx, w_scale_inv=sw, block=block, eps=eps)[:3]
    xf = x.float() if sx is None else x.float() * sx.reshape(-1, 1)
    wf = w.float() if sw is None else w.float() * sw.reshape(-1, 1)
    return mods_forward_ref(xf @ wf.t(), block, eps)


@mods_fwd.register_fake
def _(x, w, sx, sw, block, eps, split):
    M, N = x.shape[0], w.shape[0]
    h = x.new_empty((M, N), dtype=torch.bfloat16)
    return h, torch.empty_like(h), x.new_empty((M, N // block), dtype=torch.float32)


@torch.no_grad()
def mods_backward_ref(dh: Tensor, u: Tensor, r: Tensor, block: int) -> Tensor:
    """dh (M, N), u (M, N), r (M, NB) -> dz (M, N) bf16: g = dh·HardSwish'(u), dz = r·(g − u·mean_B(g·u))."""
    uf = u.float()
    slope = torch.where(uf < -3, 0.0, torch.where(uf > 3, 1.0, (2 * uf + 3) / 6))
    g = (dh.float() * slope).unflatten(-1, (-1, block))  # (M, NB, B)
    ub = uf.unflatten(-1, (-1, block))
    dz = r.unsqueeze(-1) * (g - ub * (g * ub).mean(-1, keepdim=True))
    return dz.flatten(-2).to(torch.bfloat16)


@torch.library.custom_op("loka::mods_bwd_dz", mutates_args=())
def mods_bwd_dz(dh: Tensor, u: Tensor, r: Tensor, block: int) -> Tensor:
    """dh (M, N), u (M, N) bf16, r (M, NB) fp32 -> dz (M, N) bf16."""
    if use_triton(dh):
        return triton_mods.backward_dz(dh, u, r, block=block)
    return mods_backward_ref(dh, u, r, block)


@mods_bwd_dz.register_fake
def _(dh, u, r, block):
    return dh.new_empty(dh.shape, dtype=torch.bfloat16)


def _weight_grad(name: str, dz: Tensor, x: Tensor) -> Tensor:
    """dz (M, N), x (M, K) -> dW (N, K) on backend ``name`` (bf16: one cuBLAS GEMM, no casts)."""
    if name == "bf16":
        return dz.t() @ x
    return get_backend(name).weight_grad(dz, x)


def _input_grad(name: str, dz: Tensor, w: Tensor, cache) -> Tensor:
    """dz (M, N), w (N, K) -> dx (M, K) on backend ``name``, its weight operand from ``cache``."""
    if name == "bf16":
        return dz @ w
    return get_backend(name).input_grad(dz, w, wt_q=cache.get(w, name, "input_grad"))


class LinearModsFn(torch.autograd.Function):
    """h = HardSwish(BlockNorm(x·Wᵀ)): x (M, K), w (N, K) -> h (M, N) bf16.

    ``mode`` one of FORWARD_MODES; ``dgrad``/``wgrad`` backend names; ``cache`` a ``linear.WeightCache``
    (FP8 weight operands cast once per weight version, i.e. per optimizer step).
    """

    @staticmethod
    def forward(ctx, x, w, block: int, eps: float, mode: str, dgrad: str, wgrad: str, cache):
        fp8, split = FORWARD_MODES[mode]
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        if fp8:
            xq, sx = quant_rowwise(xb)
            wq, sw = cache.get(w, FP8_WEIGHT_BACKEND, "forward")
            h, u, r = mods_fwd(xq, wq, sx, sw, block, eps, False)
        else:
            h, u, r = mods_fwd(xb, wb, None, None, block, eps, split)
        ctx.save_for_backward(xb, wb, u, r)
        ctx.block, ctx.names, ctx.cache = block, (dgrad, wgrad), cache
        ctx.dtypes = (x.dtype, w.dtype)
        return h

    @staticmethod
    def backward(ctx, dh):
        xb, wb, u, r = ctx.saved_tensors
        dgrad, wgrad = ctx.names
        dz = mods_bwd_dz(dh, u, r, ctx.block)
        dx = _input_grad(dgrad, dz, wb, ctx.cache).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(wgrad, dz, xb).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None, None


def linear_mods(x: Tensor, w: Tensor, *, block: int = 256, eps: float = 1e-6, mode: str = "fused_bf16",
                dgrad: str = "bf16", wgrad: str = "bf16", cache=None) -> Tensor:
    """HardSwish(BlockNorm(x·Wᵀ)) with fused forward and backward: x (M, K), w (N, K) -> (M, N) bf16.

    Shapes the kernels do not support (N % block, K % 16) run the differentiable reference instead.
    """
    if mode not in FORWARD_MODES:
        raise ValueError(f"linear_mods mode: unknown {mode!r}; valid: {sorted(FORWARD_MODES)}")
    if not triton_mods.supports(x.shape[-1], w.shape[0], block):
        return hard_swish(block_norm(x.float() @ w.float().t(), block, eps)).to(torch.bfloat16)
    if cache is None:
        cache = WeightCache()
    return LinearModsFn.apply(x, w, block, eps, mode, dgrad, wgrad, cache)

