"""The Triton kernel of ``triton_grads`` (imports triton at module level: import this module lazily).

See ``triton_grads`` for the math, the notation and the launcher.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.pdl_kernels import pdl_start


@triton.jit
def _dx_program(pid, dz_ptr, w_ptr, dx_ptr, M, N, K, stride_dzm, stride_wn, stride_dxm,
                BM_X: tl.constexpr, BK_X: tl.constexpr, BR_X: tl.constexpr):
    # dx tile (BM_X, BK_X) = sum over N in steps of BR_X of dz (BM_X, BR_X) · W (BR_X, BK_X)
    k_tiles = tl.cdiv(K, BK_X)
    offs_m = (pid // k_tiles) * BM_X + tl.arange(0, BM_X)
    offs_k = (pid % k_tiles) * BK_X + tl.arange(0, BK_X)
    offs_r = tl.arange(0, BR_X)
    mask_m, mask_k = offs_m < M, offs_k < K
    a_ptrs = dz_ptr + offs_m[:, None] * stride_dzm + offs_r[None, :]
    b_ptrs = w_ptr + offs_r[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BM_X, BK_X), dtype=tl.float32)
    for n in range(0, tl.cdiv(N, BR_X)):
        n_left = N - n * BR_X
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_r[None, :] < n_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_r[:, None] < n_left) & mask_k[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BR_X
        b_ptrs += BR_X * stride_wn
    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_k[None, :])


@triton.jit
def _dw_program(pid, dz_ptr, x_ptr, dw_ptr, M, N, K, stride_dzm, stride_xm, stride_dwn,
                BN_W: tl.constexpr, BK_W: tl.constexpr, BR_W: tl.constexpr):
    # dW tile (BN_W, BK_W) = sum over M in steps of BR_W of dzᵀ (BN_W, BR_W) · x (BR_W, BK_W)
    k_tiles = tl.cdiv(K, BK_W)
    offs_n = (pid // k_tiles) * BN_W + tl.arange(0, BN_W)
    offs_k = (pid % k_tiles) * BK_W + tl.arange(0, BK_W)
    offs_r = tl.arange(0, BR_W)
    mask_n, mask_k = offs_n < N, offs_k < K
    a_ptrs = dz_ptr + offs_r[None, :] * stride_dzm + offs_n[:, None]  # dzᵀ: a transposed view of row-major dz
    b_ptrs = x_ptr + offs_r[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BN_W, BK_W), dtype=tl.float32)
    for m in range(0, tl.cdiv(M, BR_W)):
        m_left = M - m * BR_W
        a = tl.load(a_ptrs, mask=mask_n[:, None] & (offs_r[None, :] < m_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_r[:, None] < m_left) & mask_k[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BR_W * stride_dzm
        b_ptrs += BR_W * stride_xm
    tl.store(dw_ptr + offs_n[:, None] * stride_dwn + offs_k[None, :], acc.to(dw_ptr.dtype.element_ty),
             mask=mask_n[:, None] & mask_k[None, :])


# (BM_X, BK_X, BR_X, BN_W, BK_W, BR_W, warps, stages): the fastest of 50 at (K, N) = (256, 256) and (512, 512),
# M = 1024 on the H200 (the first two), and neighbours of them (docs/kernels/README.md, twelfth round)
configs = [triton.Config(dict(BM_X=a, BK_X=b, BR_X=c, BN_W=d, BK_W=e, BR_W=f), num_warps=w, num_stages=s)
           for a, b, c, d, e, f, w, s in [(64, 128, 64, 64, 32, 64, 4, 4), (64, 128, 64, 64, 64, 128, 4, 4),
                                          (64, 128, 64, 64, 64, 64, 4, 4), (64, 64, 64, 64, 32, 64, 4, 3),
                                          (32, 128, 64, 32, 64, 64, 4, 4)]]


@triton.autotune(configs=configs, key=["M", "N", "K"])
@triton.jit
def grads_kernel(dz_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, M, N, K, stride_dzm, stride_xm, stride_wn, stride_dxm,
                 stride_dwn, PDL: tl.constexpr, BM_X: tl.constexpr, BK_X: tl.constexpr, BR_X: tl.constexpr,
                 BN_W: tl.constexpr, BK_W: tl.constexpr, BR_W: tl.constexpr):
    # programs [0, dx_programs) own a dx tile, the rest a dW tile
    pdl_start(PDL)
    pid = tl.program_id(0)
    dx_programs = tl.cdiv(M, BM_X) * tl.cdiv(K, BK_X)
    if pid < dx_programs:
        _dx_program(pid, dz_ptr, w_ptr, dx_ptr, M, N, K, stride_dzm, stride_wn, stride_dxm, BM_X, BK_X, BR_X)
    else:
        _dw_program(pid - dx_programs, dz_ptr, x_ptr, dw_ptr, M, N, K, stride_dzm, stride_xm, stride_dwn,
                    BN_W, BK_W, BR_W)
