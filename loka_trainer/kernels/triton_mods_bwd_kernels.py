"""The one-kernel BF16 backward of the Mods layer (``triton_mods.fused_backward``; imports triton: import lazily).

Notation as in ``triton_mods``. One launch computes both weight-side GEMMs from dy, u, r without ever writing
dz: the first programs own a (B, DW_BK) tile of dW = dzᵀ·x and walk all M rows, the rest own a (DX_BM, DX_BK)
tile of dx = dz·W and walk all NB norm blocks; each recomputes the dz tiles it needs (``_dz_tile``: dz of a
row needs its whole norm block, which is why a dW tile spans a full block). The recomputation costs reads of
dy and u that stay in L2 at small layers, where three kernels (dz, dgrad, wgrad) are launch- and
latency-bound.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.triton_mods_kernels import _dz_tile


@triton.jit
def _dw_tile(pid, dy_ptr, u_ptr, r_ptr, x_ptr, dw_ptr, M, K, stride_dym, stride_um, stride_rm, stride_xm,
             stride_dwn, BLOCK_N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    # dW[jB:(j+1)B, k-tile] = sum over row chunks of dz(chunk, block j)ᵀ · x(chunk, k-tile)
    k_tiles = tl.cdiv(K, BK)
    j, pid_k = pid // k_tiles, pid % k_tiles
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    acc = tl.zeros((BLOCK_N, BK), dtype=tl.float32)
    for m0 in range(0, M, BM):
        offs_m = m0 + tl.arange(0, BM)
        mask_m = offs_m < M  # rows past M: dy = u = r = 0 there, so their dz is 0
        dz = _dz_tile(dy_ptr, u_ptr, r_ptr, offs_m, offs_n, mask_m, j, stride_dym, stride_um, stride_rm, BLOCK_N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(dz.to(x.dtype)), x, acc)  # dz rounded to bf16 as the unfused path stores it
    tl.store(dw_ptr + offs_n[:, None] * stride_dwn + offs_k[None, :], acc.to(dw_ptr.dtype.element_ty),
             mask=mask_k[None, :])


@triton.jit
def _dx_tile(pid, dy_ptr, u_ptr, r_ptr, w_ptr, dx_ptr, M, K, NB, stride_dym, stride_um, stride_rm, stride_wn,
             stride_dxm, BLOCK_N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    # dx[m-tile, k-tile] = sum over norm blocks j of dz(m-tile, block j) · W[jB:(j+1)B, k-tile]
    k_tiles = tl.cdiv(K, BK)
    pid_m, pid_k = pid // k_tiles, pid % k_tiles
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask_m = offs_m < M
    mask_k = offs_k < K
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for j in range(0, NB):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        dz = _dz_tile(dy_ptr, u_ptr, r_ptr, offs_m, offs_n, mask_m, j, stride_dym, stride_um, stride_rm, BLOCK_N)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask_k[None, :], other=0.0)
        acc = tl.dot(dz.to(w.dtype), w, acc)
    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_k[None, :])


configs = [triton.Config({"DX_BM": dxm, "DX_BK": dxk, "DW_BM": dwm, "DW_BK": dwk}, num_warps=w, num_stages=s)
           for dxm, dxk, dwm, dwk, w, s in [(64, 64, 32, 32, 8, 2), (64, 128, 32, 64, 8, 2), (32, 64, 64, 32, 8, 2),
                                            (64, 64, 64, 64, 8, 2), (32, 128, 32, 32, 4, 2), (32, 64, 32, 16, 4, 3)]]


@triton.autotune(configs=configs, key=["M", "N", "K"])
@triton.jit
def fused_bwd_kernel(dy_ptr, u_ptr, r_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, M, N, K, stride_dym, stride_um,
                     stride_rm, stride_xm, stride_wn, stride_dxm, stride_dwn, BLOCK_N: tl.constexpr,
                     DX_BM: tl.constexpr, DX_BK: tl.constexpr, DW_BM: tl.constexpr, DW_BK: tl.constexpr):
    # programs [0, NB · cdiv(K, DW_BK)) own dW tiles (the long ones: first, so they start first), the rest dx tiles
    pid = tl.program_id(0)
    nb = N // BLOCK_N
    dw_programs = nb * tl.cdiv(K, DW_BK)
    if pid < dw_programs:
        _dw_tile(pid, dy_ptr, u_ptr, r_ptr, x_ptr, dw_ptr, M, K, stride_dym, stride_um, stride_rm, stride_xm,
                 stride_dwn, BLOCK_N, DW_BM, DW_BK)
    else:
        _dx_tile(pid - dw_programs, dy_ptr, u_ptr, r_ptr, w_ptr, dx_ptr, M, K, nb, stride_dym, stride_um,
                 stride_rm, stride_wn, stride_dxm, BLOCK_N, DX_BM, DX_BK)
