"""The Triton kernel of ``triton_grads`` (imports triton at module level: import this module lazily).

See ``triton_grads`` for the math, the notation and the launcher.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.pdl_kernels import pdl_start
from loka_trainer.kernels.triton_autotune import graph_replay_bench


@triton.jit
def _gemm_tile(tile, a_ptr, b_ptr, c_ptr, ROWS, COLS, RED, stride_a_row, stride_a_red, stride_b_red, stride_c_row,
               BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_RED: tl.constexpr):
    # tile-th (BLOCK_ROWS, BLOCK_COLS) tile of C (ROWS, COLS) = A (ROWS, RED) · B (RED, COLS), fp32 accumulation;
    # A any strides, B and C unit column stride
    col_tiles = tl.cdiv(COLS, BLOCK_COLS)
    offs_i = (tile // col_tiles) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_j = (tile % col_tiles) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    offs_r = tl.arange(0, BLOCK_RED)
    mask_i, mask_j = offs_i < ROWS, offs_j < COLS
    a_ptrs = a_ptr + offs_i[:, None] * stride_a_row + offs_r[None, :] * stride_a_red
    b_ptrs = b_ptr + offs_r[:, None] * stride_b_red + offs_j[None, :]
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for r in range(0, tl.cdiv(RED, BLOCK_RED)):
        red_left = RED - r * BLOCK_RED
        a = tl.load(a_ptrs, mask=mask_i[:, None] & (offs_r[None, :] < red_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_r[:, None] < red_left) & mask_j[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_RED * stride_a_red
        b_ptrs += BLOCK_RED * stride_b_red
    tl.store(c_ptr + offs_i[:, None] * stride_c_row + offs_j[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_i[:, None] & mask_j[None, :])


# (BM_X, BK_X, BR_X, BN_W, BK_W, BR_W, warps, stages): the fastest of 50 at (K, N) = (256, 256) and (512, 512),
# M = 1024 on the H200 (the first two), and neighbours of them
configs = [triton.Config(dict(BM_X=a, BK_X=b, BR_X=c, BN_W=d, BK_W=e, BR_W=f), num_warps=w, num_stages=s)
           for a, b, c, d, e, f, w, s in [(64, 128, 64, 64, 32, 64, 4, 4), (64, 128, 64, 64, 64, 128, 4, 4),
                                          (64, 128, 64, 64, 64, 64, 4, 4), (64, 64, 64, 64, 32, 64, 4, 3),
                                          (32, 128, 64, 32, 64, 64, 4, 4)]]


@triton.autotune(configs=configs, key=["M", "N", "K"], do_bench=graph_replay_bench)
@triton.jit
def grads_kernel(dz_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, M, N, K, stride_dzm, stride_xm, stride_wn, stride_dxm,
                 stride_dwn, PDL: tl.constexpr, BM_X: tl.constexpr, BK_X: tl.constexpr, BR_X: tl.constexpr,
                 BN_W: tl.constexpr, BK_W: tl.constexpr, BR_W: tl.constexpr):
    # programs [0, dx_programs) own a dx tile: dx (M, K) = dz (M, N) · W (N, K); the rest a dW tile:
    # dW (N, K) = dzᵀ (N, M) · x (M, K), dzᵀ read as a transposed view of row-major dz
    pdl_start(PDL)
    pid = tl.program_id(0)
    dx_programs = tl.cdiv(M, BM_X) * tl.cdiv(K, BK_X)
    if pid < dx_programs:
        _gemm_tile(pid, dz_ptr, w_ptr, dx_ptr, M, K, N, stride_dzm, 1, stride_wn, stride_dxm, BM_X, BK_X, BR_X)
    else:
        _gemm_tile(pid - dx_programs, dz_ptr, x_ptr, dw_ptr, N, K, M, 1, stride_dzm, stride_xm, stride_dwn,
                   BN_W, BK_W, BR_W)
