"""The fused LoKA Mods kernel: y = HardSwish(BlockNorm(x·Wᵀ)) in one Triton kernel (CUDA only).

Notation: M rows, K in-features, N out-features, B BlockNorm block = the kernel's N tile.

The N tile equals the norm block, so each program holds a full (BLOCK_M, B) block of x·Wᵀ in registers and
normalizes it before anything is written. Inputs are either BF16 or FP8 e4m3 with rowwise scales
(x_scale_inv (M,), w_scale_inv (N,), applied to the fp32 accumulator). Outputs: y (M, N) bf16 and optionally
the next layer's FP8 input q = sat(h · fp8_max / sqrt(B)) (static scale: |h| <= sqrt(B), see mods_ref), so the
next GEMM needs no amax/cast pass. Backward is unfused (recompute in torch) but exact w.r.t. the reference.

Requirements (else ``supports`` is False and callers use the reference): N % B == 0, B a power of two in
[16, 256], K % 16 == 0.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from loka_trainer.kernels.mods_ref import DEFAULT_BLOCK, DEFAULT_EPS, linear_mods_ref, static_fp8_scale


def supports(K: int, N: int, block: int = DEFAULT_BLOCK) -> bool:
    """True if the fused kernel can run a (K -> N) layer with this norm block."""
    pow2 = block & (block - 1) == 0
    return pow2 and 16 <= block <= 256 and N % block == 0 and K % 16 == 0


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s)
               for bm, bk, w, s in [(64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3), (32, 64, 4, 4),
                                    (16, 128, 4, 4)]]

    @triton.autotune(configs=configs, key=["M", "N", "K", "HAS_SCALES", "WRITE_FP8"])
    @triton.jit
    def fused_mods_kernel(x_ptr, w_ptr, y_ptr, q_ptr, sx_ptr, sw_ptr, M, N, K,
                          stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_qm,
                          eps, out_scale, FP8_MAX: tl.constexpr, HAS_SCALES: tl.constexpr,
                          WRITE_FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # (BLOCK_K, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_SCALES:
            sx = tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)
            sw = tl.load(sw_ptr + offs_n)
            acc = acc * sx[:, None] * sw[None, :]
        # BlockNorm over the whole N tile (= the norm block), then HardSwish, all on chip.
        rms_inv = tl.rsqrt(tl.sum(acc * acc, axis=1) / BLOCK_N + eps)
        z = acc * rms_inv[:, None]
        h = z * tl.minimum(tl.maximum(z + 3.0, 0.0), 6.0) / 6.0
        out_mask = mask_m[:, None]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], h.to(y_ptr.dtype.element_ty), mask=out_mask)
        if WRITE_FP8:
            q = tl.minimum(tl.maximum(h * out_scale, -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_n[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=out_mask)

    return triton, fused_mods_kernel


def fused_linear_mods(x: torch.Tensor, w: torch.Tensor, *, x_scale_inv: Optional[torch.Tensor] = None,
                      w_scale_inv: Optional[torch.Tensor] = None, block: int = DEFAULT_BLOCK,
                      eps: float = DEFAULT_EPS, write_fp8: bool = False
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Forward only. x (M, K), w (N, K) both bf16, or both fp8 e4m3 with x_scale_inv (M,)/(M,1) and
    w_scale_inv (N,)/(N,1) -> (y (M, N) bf16, q (M, N) e4m3 or None, q_scale_inv () fp32 or None)."""
    triton, kernel = _kernel()
    M, K = x.shape
    N = w.shape[0]
    assert supports(K, N, block), (K, N, block)
    has_scales = x_scale_inv is not None
    y = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device) if write_fp8 else y
    sx = x_scale_inv.reshape(-1).float().contiguous() if has_scales else y
    sw = w_scale_inv.reshape(-1).float().contiguous() if has_scales else y
    scale = static_fp8_scale(block)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), N // block)
    kernel[grid](x, w, y, q, sx, sw, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                 y.stride(0), q.stride(0), eps, scale, FP8_MAX=torch.finfo(torch.float8_e4m3fn).max,
                 HAS_SCALES=has_scales, WRITE_FP8=write_fp8, BLOCK_N=block)
    if not write_fp8:
        return y, None, None
    return y, q, torch.tensor(1.0 / scale, device=x.device)


class FusedLinearModsFn(torch.autograd.Function):
    """y = HardSwish(BlockNorm(x·Wᵀ)): x (M, K), w (N, K) -> y (M, N) bf16; forward fused (optionally with FP8
    rowwise-quantized operands), backward recomputed in torch from the saved high-precision x and w."""

    @staticmethod
    def forward(ctx, x, w, block: int, eps: float, fp8: bool):
        from loka_trainer.kernels.quant import quantize_rowwise
        if fp8:
            xq, sx = quantize_rowwise(x, torch.float8_e4m3fn)
            wq, sw = quantize_rowwise(w, torch.float8_e4m3fn)
            y, _, _ = fused_linear_mods(xq, wq, x_scale_inv=sx, w_scale_inv=sw, block=block, eps=eps)
        else:
            y, _, _ = fused_linear_mods(x.to(torch.bfloat16), w.to(torch.bfloat16), block=block, eps=eps)
        ctx.save_for_backward(x, w)
        ctx.block, ctx.eps = block, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xr = x.detach().to(torch.bfloat16).requires_grad_(ctx.needs_input_grad[0])
            wr = w.detach().to(torch.bfloat16).requires_grad_(ctx.needs_input_grad[1])
            # bf16 GEMM recompute (as the BF16 backend would), norm/activation grads in fp32
            z = (xr @ wr.t()).float()
            from loka_trainer.kernels.mods_ref import block_norm, hard_swish
            y = hard_swish(block_norm(z, ctx.block, ctx.eps))
            inputs = [t for t in (xr, wr) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, inputs, dy.float()))
        dx = next(grads).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = next(grads).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def linear_mods(x: torch.Tensor, w: torch.Tensor, *, block: int = DEFAULT_BLOCK, eps: float = DEFAULT_EPS,
                fp8: bool = False) -> torch.Tensor:
    """HardSwish(BlockNorm(x·Wᵀ)), x (M, K), w (N, K) -> (M, N): fused on CUDA when supported, else reference."""
    if x.is_cuda and supports(x.shape[-1], w.shape[0], block):
        return FusedLinearModsFn.apply(x, w, block, eps, fp8)
    return linear_mods_ref(x, w, block, eps).to(x.dtype)
