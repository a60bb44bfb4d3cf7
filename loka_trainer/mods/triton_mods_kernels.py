"""The Triton kernels of ``triton_mods`` (imports triton at module level: import this module lazily).

See ``triton_mods`` for the math and the notation; launchers live there.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.pdl_kernels import pdl_start
from loka_trainer.kernels.triton_autotune import graph_replay_bench
from loka_trainer.kernels.triton_quant_tensorwise_kernels import max_of


@triton.jit
def _scaled(acc, sx_ptr, sw_ptr, offs_m, offs_n, mask_m):
    # acc (BLOCK_M, BLOCK_N) times the rowwise scales sx (M,) per row and sw (N,) per column
    sx = tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)
    return acc * sx[:, None] * tl.load(sw_ptr + offs_n)[None, :]


@triton.jit
def _epilogue(acc, offs_m, offs_n, mask_m, y_ptr, u_ptr, r_ptr, q_ptr, stride_ym, stride_rm, pid_n,
              NORM_EPS: tl.constexpr, OUT_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_FP8: tl.constexpr,
              FP8_MAX_: tl.constexpr, SAVE_FOR_BACKWARD: tl.constexpr, SAVE_U: tl.constexpr):
    # BlockNorm over the whole N tile (= the norm block), then HardSwish, all on chip. NORM_EPS and OUT_SCALE are
    # constexprs, not float arguments: inductor types a float argument of a user-defined kernel fp64, which turned
    # this epilogue's math into fp64 under torch.compile (norm_fwd_kernel 16.3 µs slower at (256, 7680), H200)
    r = tl.rsqrt(tl.sum(acc * acc, axis=1) / BLOCK_N + NORM_EPS)
    u = acc * r[:, None]
    h = u * tl.minimum(tl.maximum(u + 3.0, 0.0), 6.0) / 6.0
    idx = offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None]
    tl.store(y_ptr + idx, h.to(y_ptr.dtype.element_ty), mask=mask)
    if SAVE_FOR_BACKWARD:  # r and u (or z, kept by the caller: not SAVE_U) are what the backward needs
        if SAVE_U:
            tl.store(u_ptr + idx, u.to(u_ptr.dtype.element_ty), mask=mask)
        tl.store(r_ptr + offs_m * stride_rm + pid_n, r, mask=mask_m)
    if WRITE_FP8:
        q = tl.minimum(tl.maximum(h * OUT_SCALE, -FP8_MAX_), FP8_MAX_)
        tl.store(q_ptr + idx, q.to(q_ptr.dtype.element_ty), mask=mask)

# the two 4-warp 64-row tiles: 17.1 vs 22.8 us (FP8) and 37.4 vs 41.9 us (bf16) at (K, N) = (4096, 2048), M = 1024,
# against the autotuner's pick among the others (H200, ``benchmarks/bench_fused_forward_gpu.py``)
configs = [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s)
           for bm, bk, w, s in [(64, 64, 8, 3), (128, 64, 8, 3), (64, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 4),
                                (32, 64, 4, 4), (32, 128, 4, 3), (16, 128, 4, 4), (16, 256, 4, 3)]]

@triton.jit
def fused_fwd_kernel(x_ptr, w_ptr, y_ptr, u_ptr, r_ptr, q_ptr, sx_ptr, sw_ptr, ws_ptr, M, N, K,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_rm, stride_ws,
                     NORM_EPS: tl.constexpr, OUT_SCALE: tl.constexpr, FP8_MAX_: tl.constexpr,
                     HAS_SCALES: tl.constexpr, WRITE_FP8: tl.constexpr, SAVE_FOR_BACKWARD: tl.constexpr,
                     SPLIT_K: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    # SPLIT_K > 1: program (m, n, s) sums the s-th of SPLIT_K slices of K's tiles and stores its (scaled) fp32
    # partial z into ws (SPLIT_K, M, N); norm_fwd_kernel then adds the slices and runs the epilogue.
    pdl_start(PDL)  # may be launched before the previous kernel ended (pdl.py): waits for it before any access
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * tiles_per_split
    k_end = tl.minimum(k_first + tiles_per_split, k_tiles)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_first * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # (BLOCK_K, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_end):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_SCALES:
        acc = _scaled(acc, sx_ptr, sw_ptr, offs_m, offs_n, mask_m)
    if SPLIT_K == 1:
        _epilogue(acc, offs_m, offs_n, mask_m, y_ptr, u_ptr, r_ptr, q_ptr, stride_ym, stride_rm, pid_n, NORM_EPS,
                  OUT_SCALE, BLOCK_N, WRITE_FP8, FP8_MAX_, SAVE_FOR_BACKWARD, True)
    else:
        tl.store(ws_ptr + pid_k * stride_ws + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask_m[:, None])


_FWD_KEY = ["M", "N", "K", "HAS_SCALES", "WRITE_FP8", "SAVE_FOR_BACKWARD", "SPLIT_K"]
# NOTE: timed eagerly (Triton's benchmarker, L2 flushed), not by graph replay (triton_autotune): with replay the
# picks made the layer up to 10% slower at the large figure-13 shapes on the H200 (CHANGELOG.md, "Tried and
# reverted")
fused_fwd_eager_tuned = triton.autotune(configs=configs, key=_FWD_KEY)(fused_fwd_kernel)
# the same kernel timed by graph replay, for a short K (triton_mods.REPLAY_TUNED_MAX_K): a few µs of GPU time
# under a launch's, which eager timing ranks by noise (on the H200 its picks at (K, N) = (512, 512) differed from
# run to run by 2.3 µs of 5.7; CHANGELOG.md, 2026-12-01)
fused_fwd_replay_tuned = triton.autotune(configs=configs, key=_FWD_KEY, do_bench=graph_replay_bench)(
    fused_fwd_kernel)


@triton.jit
def norm_fwd_kernel(z_ptr, sx_ptr, sw_ptr, y_ptr, u_ptr, r_ptr, q_ptr, M, stride_zm, stride_zs, stride_ym,
                    stride_rm, NORM_EPS: tl.constexpr, OUT_SCALE: tl.constexpr, FP8_MAX_: tl.constexpr,
                    WRITE_FP8: tl.constexpr, SAVE_FOR_BACKWARD: tl.constexpr, SAVE_Z: tl.constexpr,
                    SPLITS: tl.constexpr, HAS_SCALES: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    # z = the sum of SPLITS slices z_ptr + s * stride_zs (1: a plain z; > 1: fused_fwd_kernel's split-K partials),
    # times sx (M,) per row and sw (N,) per column if HAS_SCALES (an FP8 GEMM's rowwise scales, applied here).
    # SAVE_Z: the backward reads z (before the scales) instead of u: with SPLITS > 1 the summed z goes to u_ptr
    # (bf16), else the caller keeps z itself and u is not written
    pdl_start(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    z_ptrs = z_ptr + offs_m[:, None] * stride_zm + offs_n[None, :]
    z = tl.load(z_ptrs, mask=mask_m[:, None], other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        z += tl.load(z_ptrs + s * stride_zs, mask=mask_m[:, None], other=0.0)
    if SAVE_FOR_BACKWARD and SAVE_Z and SPLITS > 1:
        tl.store(u_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], z.to(u_ptr.dtype.element_ty),
                 mask=mask_m[:, None])
    if HAS_SCALES:
        z = _scaled(z, sx_ptr, sw_ptr, offs_m, offs_n, mask_m)
    _epilogue(z, offs_m, offs_n, mask_m, y_ptr, u_ptr, r_ptr, q_ptr, stride_ym, stride_rm,
              pid_n, NORM_EPS, OUT_SCALE, BLOCK_N, WRITE_FP8, FP8_MAX_, SAVE_FOR_BACKWARD, not SAVE_Z)

@triton.jit
def dz_tile(dy_ptr, u_ptr, r_ptr, zs_row_ptr, zs_col_ptr, offs_m, offs_n, mask_m, j, stride_dym, stride_um,
            stride_rm, FROM_Z: tl.constexpr, Z_SCALES: tl.constexpr, BLOCK_N: tl.constexpr):
    # dz (BLOCK_M, BLOCK_N) fp32 of norm block j: g = dy·HardSwish'(u), dz = r·(g − u·mean_B(g·u)).
    # FROM_Z: u_ptr holds z, u = z·r (z times zs_row (M,) per row and zs_col (N,) per column first if Z_SCALES,
    # the forward's order of operations)
    mask = mask_m[:, None]
    dy = tl.load(dy_ptr + offs_m[:, None] * stride_dym + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs_m[:, None] * stride_um + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs_m * stride_rm + j, mask=mask_m, other=0.0)
    if FROM_Z:
        if Z_SCALES:
            u = _scaled(u, zs_row_ptr, zs_col_ptr, offs_m, offs_n, mask_m)
        u = u * r[:, None]
    slope = tl.where(u < -3.0, 0.0, tl.where(u > 3.0, 1.0, (2.0 * u + 3.0) / 6.0))  # HardSwish'(u)
    g = dy * slope
    mean_gu = tl.sum(g * u, axis=1) / BLOCK_N
    return r[:, None] * (g - u * mean_gu[:, None])

@triton.jit
def _max_out(ptr, tile_max, pid_m, pid_n, TILE_MAXIMA: tl.constexpr):
    if TILE_MAXIMA:
        tl.store(ptr + pid_m * tl.num_programs(1) + pid_n, tile_max)
    else:
        tl.atomic_max(ptr, tile_max)  # a max: exact in any order

@triton.jit
def bwd_dz_kernel(dy_ptr, u_ptr, r_ptr, zs_row_ptr, zs_col_ptr, dz_ptr, amax_ptr, sx_ptr, fold_amax_ptr, M,
                  stride_dym, stride_um, stride_rm, stride_dzm, stride_am, FROM_Z: tl.constexpr,
                  Z_SCALES: tl.constexpr, AMAX: tl.constexpr, FOLD: tl.constexpr, TILE_MAXIMA: tl.constexpr,
                  PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # u_ptr: u, or z (FROM_Z, Z_SCALES: dz_tile)
    # AMAX: 0 none, 1 each (row, block) amax into amax_ptr (M, NB), 2 the amax of dz into amax_ptr;
    # FOLD: also max |dz·sx| (sx (M,) fp32) into fold_amax_ptr (the folded weight grad's, wgrad_fold).
    # TILE_MAXIMA: those two as this program's tile max at [pid_m·NB + pid_n] (max_of reads them; no atomics,
    # nothing to zero first), else one atomic max into a zeroed scalar.
    pdl_start(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    dz = dz_tile(dy_ptr, u_ptr, r_ptr, zs_row_ptr, zs_col_ptr, offs_m, offs_n, mask_m, pid_n, stride_dym,
                 stride_um, stride_rm, FROM_Z, Z_SCALES, BLOCK_N)
    dz = dz.to(dz_ptr.dtype.element_ty)
    tl.store(dz_ptr + offs_m[:, None] * stride_dzm + offs_n[None, :], dz, mask=mask_m[:, None])
    # of the stored (rounded) dz, so the FP8 cast matches quantizing the bf16 dz (masked rows hold zeros)
    if AMAX == 1:
        tl.store(amax_ptr + offs_m * stride_am + pid_n, tl.max(tl.abs(dz.to(tl.float32)), axis=1), mask=mask_m)
    if AMAX == 2:
        _max_out(amax_ptr, tl.max(tl.abs(dz.to(tl.float32))), pid_m, pid_n, TILE_MAXIMA)
    if FOLD:
        sx = tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)
        _max_out(fold_amax_ptr, tl.max(tl.abs(dz.to(tl.float32) * sx[:, None])), pid_m, pid_n, TILE_MAXIMA)


@triton.jit
def quant_rows_kernel(dz_ptr, amax_ptr, q_ptr, s_ptr, sx_ptr, fold_amax_ptr, qt_ptr, st_ptr, M, NB, stride_dzm,
                      stride_am, stride_qm, N_FOLD_AMAX, FP8_MAX_: tl.constexpr, EPS_: tl.constexpr,
                      NB_P2: tl.constexpr, FOLD: tl.constexpr, FOLD_FP8_MAX: tl.constexpr, PDL: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # Row amax from the (M, NB) per-block amaxes bwd_dz_kernel wrote: no pass over dz to find it, so this
    # kernel reads dz once and is as parallel (rows x blocks) as the dz kernel.
    # FOLD: also qt (N, M) = (dz·sx)ᵀ cast at the tensorwise scale of fold_amax (the max of its N_FOLD_AMAX
    # values; the folded weight grad's dz operand, wgrad_fold), its scale_inv into st_ptr, from the same read
    # of dz.
    pdl_start(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, NB_P2)
    mask_m = offs_m < M
    a = tl.load(amax_ptr + offs_m[:, None] * stride_am + offs_b[None, :],
                mask=mask_m[:, None] & (offs_b[None, :] < NB), other=0.0)
    # same guard as quant.amax_to_scale: an all-zero row gets a finite scale and exact zeros
    scale = FP8_MAX_ / tl.minimum(tl.maximum(tl.max(a, axis=1), EPS_), 3.4028234663852886e38)
    mask = mask_m[:, None]
    dz = tl.load(dz_ptr + offs_m[:, None] * stride_dzm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(dz * scale[:, None], -FP8_MAX_), FP8_MAX_)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_n[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if pid_n == 0:
        tl.store(s_ptr + offs_m, 1.0 / scale, mask=mask_m)
    if FOLD:
        scale_t = tl.math.div_rn(FOLD_FP8_MAX, tl.minimum(tl.maximum(max_of(fold_amax_ptr, N_FOLD_AMAX), EPS_),
                                                        3.4028234663852886e38))
        v = dz * tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        qt = tl.minimum(tl.maximum(v * scale_t, -FOLD_FP8_MAX), FOLD_FP8_MAX)
        tl.store(qt_ptr + offs_n[None, :] * M + offs_m[:, None], qt.to(qt_ptr.dtype.element_ty), mask=mask)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(st_ptr, 1.0 / scale_t)
