"""The Triton kernels of ``wgrad_fold`` (imports triton at module level: import this module lazily).

dz (M, N) bf16, sx (M,) fp32 the forward's row scales of x, xq (M, K) e4m3; see ``wgrad_fold`` for the math.
Tiles (BLOCK_R, BLOCK_C) over a row-major operand, one program per tile, a 1-D grid.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.pdl_kernels import pdl_start
from loka_trainer.kernels.triton_quant_tensorwise_kernels import max_of


@triton.jit
def _tile(tile, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    tiles_c = tl.cdiv(C, BLOCK_C)
    rows = (tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows, cols, (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def _scaled_dz(dz_ptr, sx_ptr, rows, cols, mask, M, stride_dzm):
    # dz·sx (BLOCK_R, BLOCK_C) fp32: each row of dz times its row of x's scale
    dz = tl.load(dz_ptr + rows[:, None] * stride_dzm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return dz * tl.load(sx_ptr + rows, mask=rows < M, other=0.0)[:, None]


@triton.jit
def fold_amax_kernel(dz_ptr, sx_ptr, amax_ptr, M, N, stride_dzm, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_start(PDL)
    rows, cols, mask = _tile(tl.program_id(0), M, N, BLOCK_R, BLOCK_C)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(_scaled_dz(dz_ptr, sx_ptr, rows, cols, mask, M, stride_dzm))))


@triton.jit
def fold_transpose_kernel(dz_ptr, sx_ptr, amax_ptr, dzt_ptr, s_ptr, xq_ptr, xqt_ptr, M, N, K, stride_dzm,
                          stride_xm, N_AMAX, FP8_MAX: tl.constexpr, EPS_: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    # programs [0, tiles of dz): dzt (N, M) = cast(dz·sx·scale)ᵀ; the rest: xqt (K, M) = xqᵀ (a plain copy)
    pdl_start(PDL)
    dz_tiles = tl.cdiv(M, BLOCK_R) * tl.cdiv(N, BLOCK_C)
    pid = tl.program_id(0)
    if pid < dz_tiles:
        rows, cols, mask = _tile(pid, M, N, BLOCK_R, BLOCK_C)
        # NOTE: same guard as quant.amax_to_scale: an all-zero dz gets a finite scale and exact zeros.
        scale = tl.math.div_rn(FP8_MAX, tl.minimum(tl.maximum(max_of(amax_ptr, N_AMAX), EPS_), 3.4028234663852886e38))
        v = _scaled_dz(dz_ptr, sx_ptr, rows, cols, mask, M, stride_dzm)
        q = tl.minimum(tl.maximum(v * scale, -FP8_MAX), FP8_MAX)
        tl.store(dzt_ptr + cols[None, :] * M + rows[:, None], q.to(dzt_ptr.dtype.element_ty), mask=mask)
        if pid == 0:
            tl.store(s_ptr, 1.0 / scale)
    else:
        rows, cols, mask = _tile(pid - dz_tiles, M, K, BLOCK_R, BLOCK_C)
        a = tl.load(xq_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask)
        tl.store(xqt_ptr + cols[None, :] * M + rows[:, None], a, mask=mask)
