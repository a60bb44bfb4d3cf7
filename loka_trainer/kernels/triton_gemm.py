"""Triton blockwise FP8 GEMM and its 1×128 / 128×128 quantizers (CUDA, quantizers also on the interpreter;
triton is imported on first use).

Notation: a (R, C) and b (P, C) row-major, contraction over C, G = ceil(C / 128).

- ``quantize_1x128(x (R, C))`` -> q (R, C) e4m3, scale_inv (R, G) fp32: same math as
  ``quant.quantize_block1x128`` (amax per row and 128-group, clamp EPS, saturating cast).
- ``quantize_128x128(x (R, C))`` -> q, scale_inv (ceil(R/128), G): ``quant.quantize_block128x128`` (weights).
- ``blockwise_mm_nt(qa, sa (R, G), qb, sb)`` -> a·bᵀ (R, P) bf16, where sb is (P, G) for 1×128 or
  (ceil(P/128), G) for 128×128 b scales. BLOCK_K = 128 so each K step applies one scale per a row and one
  per b row/tile to the partial product: acc += (a_k · b_kᵀ) · sa_k[:, None] · sb_k[None, :].
"""
from __future__ import annotations

import functools

import torch

from loka_trainer.kernels.quant import BLOCK, EPS


@functools.lru_cache(maxsize=1)
def _kernels():
    """Define the Triton kernels once (importing triton here, never at module import)."""
    import triton
    import triton.language as tl

    @triton.jit
    def quant_block_kernel(x_ptr, q_ptr, s_ptr, R, C, stride_xr, stride_xc, stride_qr, stride_sr,
                           FP8_MAX: tl.constexpr, EPS_: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
                           TILE_SCALE: tl.constexpr):
        # one program per (ROWS, GROUP) tile; TILE_SCALE: one scale for the tile (128x128), else one per row
        pid_r, g = tl.program_id(0), tl.program_id(1)
        rows = pid_r * ROWS + tl.arange(0, ROWS)
        cols = g * GROUP + tl.arange(0, GROUP)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
        x = x.to(tl.float32)
        # NOTE: same guard as quant.amax_to_scale: all-zero groups get a finite scale and exact zeros.
        row_amax = tl.minimum(tl.maximum(tl.max(tl.abs(x), axis=1), EPS_), 3.4028234663852886e38)  # (ROWS,)
        if TILE_SCALE:
            scale = tl.math.div_rn(FP8_MAX, tl.max(row_amax, axis=0))
            q = tl.minimum(tl.maximum(x * scale, -FP8_MAX), FP8_MAX)
            tl.store(s_ptr + pid_r * stride_sr + g, 1.0 / scale)
        else:
            scale = tl.math.div_rn(FP8_MAX, row_amax)
            q = tl.minimum(tl.maximum(x * scale[:, None], -FP8_MAX), FP8_MAX)
            tl.store(s_ptr + rows * stride_sr + g, 1.0 / scale, mask=rows < R)
        tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
               for bm, bn, w, s in [(128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 4)]]

    @triton.autotune(configs=configs, key=["R", "P", "C", "B_ROWS_PER_SCALE"])
    @triton.jit
    def blockwise_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, R, P, C,
                         stride_ar, stride_ac, stride_bp, stride_bc, stride_cr, stride_cp,
                         stride_sar, stride_sag, stride_sbp, stride_sbg,
                         B_ROWS_PER_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(R, BLOCK_M), tl.cdiv(P, BLOCK_N)
        group = pid // (GROUP_M * num_n)  # grouped launch order: neighbouring programs share b tiles in L2
        first_m = group * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % size_m)
        pid_n = (pid % (GROUP_M * num_n)) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m, mask_n = offs_m < R, offs_n < P
        a_ptrs = a_ptr + offs_m[:, None] * stride_ar + offs_k[None, :] * stride_ac
        b_ptrs = b_ptr + offs_n[None, :] * stride_bp + offs_k[:, None] * stride_bc  # (BLOCK_K, BLOCK_N)
        sa_ptrs = sa_ptr + offs_m * stride_sar
        sb_ptrs = sb_ptr + (offs_n // B_ROWS_PER_SCALE) * stride_sbp
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(C, BLOCK_K)):
            k_left = C - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
            sa = tl.load(sa_ptrs + k * stride_sag, mask=mask_m, other=0.0)
            sb = tl.load(sb_ptrs + k * stride_sbg, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
            a_ptrs += BLOCK_K * stride_ac
            b_ptrs += BLOCK_K * stride_bc
        c_ptrs = c_ptr + offs_m[:, None] * stride_cr + offs_n[None, :] * stride_cp
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    return triton, quant_block_kernel, blockwise_kernel


def _quantize_blocks(x: torch.Tensor, dtype: torch.dtype, rows_per_scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) any strides -> q (R, C) fp8 contiguous, scale_inv (ceil(R / rows_per_scale), G) fp32; one
    scale per row (rows_per_scale 1) or per 128x128 tile (rows_per_scale 128) and 128-wide group."""
    triton, kernel, _ = _kernels()
    R, C = x.shape
    G = triton.cdiv(C, BLOCK)
    tile = rows_per_scale == BLOCK
    rows = BLOCK if tile else 16
    q = torch.empty((R, C), dtype=dtype, device=x.device)
    s = torch.empty((triton.cdiv(R, rows_per_scale), G), dtype=torch.float32, device=x.device)
    kernel[(triton.cdiv(R, rows), G)](x, q, s, R, C, x.stride(0), x.stride(1), q.stride(0), s.stride(0),
                                      FP8_MAX=torch.finfo(dtype).max, EPS_=EPS, ROWS=rows, GROUP=BLOCK,
                                      TILE_SCALE=tile, num_warps=8 if tile else 4)
    return q, s


def quantize_1x128(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) CUDA -> q (R, C) fp8 contiguous, scale_inv (R, G) fp32 (``quant.quantize_block1x128``)."""
    return _quantize_blocks(x, dtype, 1)


def quantize_128x128(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) CUDA -> q (R, C) fp8 contiguous, scale_inv (ceil(R/128), G) fp32 (``quant.quantize_block128x128``)."""
    return _quantize_blocks(x, dtype, BLOCK)


def blockwise_mm_nt(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """qa (R, C) fp8 + sa (R, G); qb (P, C) fp8 + sb (P, G) or (ceil(P/128), G) -> (R, P) out_dtype."""
    triton, _, kernel = _kernels()
    R, C = qa.shape
    P = qb.shape[0]
    assert qb.shape[1] == C and sa.shape == (R, triton.cdiv(C, BLOCK)), (qa.shape, sa.shape, qb.shape)
    b_rows = 1 if sb.shape[0] == P else BLOCK
    c = torch.empty((R, P), dtype=out_dtype, device=qa.device)
    grid = lambda meta: (triton.cdiv(R, meta["BLOCK_M"]) * triton.cdiv(P, meta["BLOCK_N"]),)
    kernel[grid](qa, qb, c, sa, sb, R, P, C, qa.stride(0), qa.stride(1), qb.stride(0), qb.stride(1),
                 c.stride(0), c.stride(1), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
                 B_ROWS_PER_SCALE=b_rows, BLOCK_K=BLOCK)
    return c
