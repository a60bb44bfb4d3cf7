"""The Triton kernel of ``triton_mods_bwd`` (imports triton at module level: import this module lazily).

See ``triton_mods_bwd`` for the math, the notation and the launcher.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.pdl_kernels import pdl_start
from loka_trainer.kernels.triton_mods_kernels import _dz_tile

# (BLOCK_M, BLOCK_K, ROWS_W, M_SPLITS, warps): dx tiles of BLOCK_M rows, dW tiles walking M / M_SPLITS rows
# ROWS_W at a time; every config holds one (BLOCK_M or ROWS_W, B) fp32 dz tile and one accumulator on chip
configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "ROWS_W": rw, "M_SPLITS": s}, num_warps=w, num_stages=2)
           for bm, bk, rw, s, w in [(32, 64, 32, 8, 4), (32, 64, 32, 16, 4), (64, 64, 32, 16, 8),
                                    (32, 128, 32, 8, 8), (16, 64, 32, 16, 4), (32, 32, 32, 32, 4)]]


@triton.jit
def _dx_program(pid, dy_ptr, u_ptr, r_ptr, w_ptr, dx_ptr, M, N, K, k_tiles, stride_dym, stride_um, stride_rm,
                stride_wn, stride_dxm, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # dx tile (BLOCK_M, BLOCK_K) = sum over norm blocks j of dz_j · W_j, each dz_j (BLOCK_M, B) made on chip
    pid_m, pid_k = pid // k_tiles, pid % k_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m, mask_k = offs_m < M, offs_k < K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for j in range(0, N // BLOCK_N):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        dz = _dz_tile(dy_ptr, u_ptr, r_ptr, offs_m, offs_n, mask_m, j, stride_dym, stride_um, stride_rm, BLOCK_N)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask_k[None, :], other=0.0)
        acc = tl.dot(dz.to(w.dtype), w, acc)
    tl.store(dx_ptr + offs_m[:, None] * stride_dxm + offs_k[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_k[None, :])


@triton.jit
def _dw_program(q, dy_ptr, u_ptr, r_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr, M, K, k_tiles, stride_dym, stride_um,
                stride_rm, stride_xm, stride_dwn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ROWS_W: tl.constexpr, M_SPLITS: tl.constexpr):
    # program q = (tile, split): dW tile (B, BLOCK_K) of norm block j summed over the split-th of M_SPLITS row
    # ranges, then added into the fp32 workspace ws (N, K); the last split to arrive (count_ptr[tile]) writes
    # the tile in dW's dtype and puts ws and the count back to zero, so the next launch finds them clean
    tile, split = q // M_SPLITS, q % M_SPLITS
    j, pid_k = tile // k_tiles, tile % k_tiles
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    rows = tl.cdiv(tl.cdiv(M, M_SPLITS), ROWS_W) * ROWS_W
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(split * rows, tl.minimum(split * rows + rows, M), ROWS_W):
        offs_m = m0 + tl.arange(0, ROWS_W)
        mask_m = offs_m < M
        # rows past M load zeros: their dz is 0 and adds nothing
        dz = _dz_tile(dy_ptr, u_ptr, r_ptr, offs_m, offs_n, mask_m, j, stride_dym, stride_um, stride_rm, BLOCK_N)
        xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                     other=0.0)
        acc = tl.dot(tl.trans(dz.to(xs.dtype)), xs, acc)
    dw_idx = offs_n[:, None] * stride_dwn + offs_k[None, :]
    ws_idx = offs_n[:, None] * K + offs_k[None, :]
    mask = mask_k[None, :]
    if M_SPLITS == 1:
        tl.store(dw_ptr + dw_idx, acc.to(dw_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ws_ptr + ws_idx, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's adds are issued before the count (acq_rel) publishes them
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == M_SPLITS - 1:
            total = tl.load(ws_ptr + ws_idx, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(dw_ptr + dw_idx, total.to(dw_ptr.dtype.element_ty), mask=mask)
            tl.store(ws_ptr + ws_idx, tl.zeros_like(total), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.autotune(configs=configs, key=["M", "N", "K"])
@triton.jit
def bwd_one_kernel(dy_ptr, u_ptr, r_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, ws_ptr, count_ptr, M, N, K,
                   stride_dym, stride_um, stride_rm, stride_xm, stride_wn, stride_dxm, stride_dwn,
                   PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROWS_W: tl.constexpr, M_SPLITS: tl.constexpr):
    # programs [0, dx_programs) each own a dx tile, the rest a dW tile and one of M_SPLITS row ranges
    pdl_start(PDL)
    pid = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    dx_programs = tl.cdiv(M, BLOCK_M) * k_tiles
    if pid < dx_programs:
        _dx_program(pid, dy_ptr, u_ptr, r_ptr, w_ptr, dx_ptr, M, N, K, k_tiles, stride_dym, stride_um, stride_rm,
                    stride_wn, stride_dxm, BLOCK_N, BLOCK_M, BLOCK_K)
    else:
        _dw_program(pid - dx_programs, dy_ptr, u_ptr, r_ptr, x_ptr, dw_ptr, ws_ptr, count_ptr, M, K, k_tiles,
                    stride_dym, stride_um, stride_rm, stride_xm, stride_dwn, BLOCK_N, BLOCK_K, ROWS_W, M_SPLITS)
