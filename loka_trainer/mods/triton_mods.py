"""Triton kernels of the LoKA Mods layer h = HardSwish(BlockNorm(z)), z = x·Wᵀ (CUDA, or the interpreter).

Notation: M rows, K in-features, N out-features, B the BlockNorm block = the kernel's N tile, NB = N / B.
u = BlockNorm(z) (each B-block of a row scaled to RMS 1), r = 1 / RMS (M, NB) fp32, h = u·ReLU6(u+3)/6.

- ``fused_forward``: GEMM -> BlockNorm -> HardSwish in one kernel. The N tile is the norm block, so the
  (BLOCK_M, B) accumulator is normalized on chip. Inputs bf16, or fp8 e4m3 with rowwise scales (applied to
  the fp32 accumulator). Writes h (M, N) bf16, and what backward needs: u (M, N) bf16 and r (M, NB) fp32;
  optionally the next layer's FP8 input q = sat(h · fp8_max / sqrt(B)) (|h| <= sqrt(B), see mods.reference).
  Split-K where (M / 64) · NB programs leave most SMs idle and K is long (``split_k_for``): each K slice's
  programs write an fp32 partial z, and the ``norm_forward`` kernel sums the slices before its epilogue.
- ``norm_forward``: the same epilogue on a z computed elsewhere (cuBLAS): for shapes where one fused
  kernel has too few programs (small N, long K), cuBLAS + this kernel is faster. z may also come as fp32
  partial sums over K slices (``cublas_split_k``: for few output tiles over a long K, e.g. (K, N) = (7680, 256),
  M = 1024), which the kernel adds before normalizing: no separate reduction kernel, no bf16 z in between.
- ``backward_dz``: dz from dh in one pass: g = dh·HardSwish'(u), dz = r·(g − u·mean_B(g·u)) per block.
  dx = dz·W and dW = dzᵀ·x are then plain GEMMs (cuBLAS or an FP8 backend).
- ``backward_dz_fp8``: the same dz, plus its FP8 quantization for an FP8 dgrad GEMM (``DZ_FP8``). Rowwise
  e4m3: the dz kernel also writes each (row, block) amax (M, NB), then one cast kernel reads dz once (the row
  amax comes from the small buffer), both parallel over rows x blocks. Tensorwise e5m2: the dz kernel writes
  its tiles' amaxes (each cast program takes their max: no atomics, no zeroed scalar; ``MAX_TILE_MAXIMA``),
  then the tensorwise cast pass. Against dz kernel + quantization kernel this saves the quantizer's amax pass
  over dz. (A single kernel whose programs own whole
  rows was measured first on the H200: latency-bound at M = 1024, 1.5x slower than unfused at N = 7680.)

On Hopper and later every kernel here launched eagerly uses programmatic dependent launch (``pdl``): it may be
scheduled while the kernel before it drains and waits for it (``gdc_wait``) before touching memory. Compiled, the
ops are ``triton_op``s whose kernels inductor launches, without PDL (``pdl.active`` says why).

Requirements (else ``supports`` is False and callers use the reference): N % B == 0, B a power of two in
[16, 256], K % 16 == 0.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from loka_trainer.kernels import pdl
from loka_trainer.kernels.quant import EPS
from loka_trainer.kernels.triton_env import launcher
from loka_trainer.kernels.triton_quant import fixed_or_autotuned, rows_contiguous, scale_vector
from loka_trainer.mods.reference import DEFAULT_BLOCK, DEFAULT_EPS, static_fp8_scale
from loka_trainer.mods.shapes import supports
from loka_trainer.mods.wgrad_fold import DZ_DTYPE, fold_dz_with_amax

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


@functools.lru_cache(maxsize=1)
def _kernels():
    """Import the kernels once (importing triton there, never at this module's import)."""
    import triton

    from loka_trainer.mods import triton_mods_kernels as k
    return triton, k.fused_fwd_eager_tuned, k.norm_fwd_kernel, k.bwd_dz_kernel


# the fused forward's configs are timed by graph replay up to this K, eagerly above (triton_mods_kernels)
REPLAY_TUNED_MAX_K = 512


@functools.lru_cache(maxsize=1)
def _replay_tuned_forward():
    """``fused_fwd_kernel`` autotuned by graph replay (imported lazily, like ``_kernels``)."""
    from loka_trainer.mods import triton_mods_kernels as k
    return k.fused_fwd_replay_tuned


def _forward_kernel(K: int):
    """The fused forward's autotuned kernel for a layer of ``K`` in-features: timed by graph replay when short."""
    return _replay_tuned_forward() if K <= REPLAY_TUNED_MAX_K else _kernels()[1]


@functools.lru_cache(maxsize=1)
def _quant_kernel():
    """The FP8 cast kernel of ``backward_dz_fp8`` (imported lazily, like ``_kernels``)."""
    from loka_trainer.mods import triton_mods_kernels as k
    return k.quant_rows_kernel


def _outputs(M: int, N: int, block: int, device, write_fp8: bool, save: bool, save_u: bool = True):
    """Output buffers; those not written are stand-ins the kernel never touches (u = y, r of 0 rows, q = y)."""
    y = torch.empty((M, N), dtype=torch.bfloat16, device=device)
    u = torch.empty((M, N), dtype=torch.bfloat16, device=device) if save and save_u else y
    r = torch.empty((M if save else 0, N // block), dtype=torch.float32, device=device)
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=device) if write_fp8 else y
    return y, u, r, q


def _returned(y, u, r, q, write_fp8: bool, save: bool):
    return y, (u if save else None), (r if save else None), (q if write_fp8 else None)


# split-K: fill the GPU when (M / 64) x NB programs are too few for its SMs, keeping >= this many K per slice
MIN_K_PER_SPLIT = 512
MAX_SPLIT_K = 8


def split_k_for(M: int, N: int, K: int, block: int, num_sms: int) -> int:
    """How many K slices ``fused_forward`` sums separately: the largest power of two <= MAX_SPLIT_K that keeps
    (M / 64) · (N / block) · split programs within one wave of ``num_sms`` and K / split >= MIN_K_PER_SPLIT."""
    programs = -(-M // 64) * (N // block)
    split = 1
    while (split * 2 <= MAX_SPLIT_K and programs * split * 2 <= num_sms
           and K // (split * 2) >= MIN_K_PER_SPLIT):
        split *= 2
    return split


def cublas_split_k_for(x: torch.Tensor, N: int, block: int) -> int:
    """How many K slices the split modes' BF16 GEMM x (M, K) · Wᵀ runs as: ``split_k_for`` on CUDA, halved
    until it divides K; 1 elsewhere."""
    if not x.is_cuda:
        return 1
    M, K = x.shape
    split = split_k_for(M, N, K, block, sm_count(x.device.index or 0))
    while K % split:
        split //= 2
    return split


def cublas_split_k(x: torch.Tensor, w: torch.Tensor, split: int) -> torch.Tensor:
    """x (M, K), w (N, K) bf16, K % split == 0 -> (split, M, N) fp32: the products of ``split`` equal K slices, as
    one strided-batched cuBLAS GEMM on CUDA (``torch.bmm(out_dtype=float32)``: bf16 inputs, fp32 accumulate and
    output; no copies of x or W). Elsewhere the same slices in fp32 (CPU has no bf16 -> fp32 bmm)."""
    M, K = x.shape
    N = w.shape[0]
    xs = x.contiguous().view(M, split, K // split).transpose(0, 1)  # (split, M, K / split)
    ws = w.contiguous().view(N, split, K // split).permute(1, 2, 0)  # (split, K / split, N)
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The number of SMs of CUDA device ``device_index`` (cached)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def autotune_picks(kernel=None) -> list[dict]:
    """The configs the autotuner picked for the fused forward (both of its autotuners, ``_forward_kernel``) or for
    ``kernel`` in this process, one per key it has tuned: [{"key": {M, N, K, HAS_SCALES, ...: value, "dtypes":
    [tensor dtypes]}, "config": {BLOCK_M, BLOCK_K, num_warps, num_stages, ...}}]. What a benchmark records so that
    configs never picked can be pruned later."""
    if kernel is None:
        return autotune_picks(_kernels()[1]) + autotune_picks(_replay_tuned_forward())
    names = list(kernel.keys)  # a key holds these arguments' values, then the dtypes of the tensor arguments
    return [{"key": {**dict(zip(names, key)), "dtypes": [str(v) for v in key[len(names):]]},
             "config": dict(config.all_kwargs())} for key, config in kernel.cache.items()]


def fused_forward(x: torch.Tensor, w: torch.Tensor, *, x_scale_inv: Optional[torch.Tensor] = None,
                  w_scale_inv: Optional[torch.Tensor] = None, block: int = DEFAULT_BLOCK,
                  eps: float = DEFAULT_EPS, write_fp8: bool = False, save: bool = True,
                  split_k: Optional[int] = None, config: Optional[dict] = None):
    """x (M, K), w (N, K) both bf16, or both fp8 e4m3 with x_scale_inv (M,)/(M,1), w_scale_inv (N,)/(N,1)
    -> (h (M, N) bf16, u (M, N) bf16, r (M, NB) fp32, q (M, N) e4m3 or None); u, r are None unless ``save``
    (what the backward needs; inference skips writing them).

    ``split_k`` (default ``split_k_for`` on CUDA, 1 elsewhere): > 1 splits K into that many slices, each
    summed by its own programs into an fp32 (split_k, M, N) workspace; the epilogue kernel (``norm_forward``'s)
    adds them. For long K and few (M, N) tiles, e.g. (K, N) = (7680, 256) at M = 1024: 16 programs alone.
    ``config`` (BLOCK_M, BLOCK_K, optionally num_warps / num_stages) replaces the autotuner's choice."""
    triton = _kernels()[0]
    M, K = x.shape
    N = w.shape[0]
    assert supports(K, N, block), (K, N, block)
    if split_k is None:
        split_k = split_k_for(M, N, K, block, sm_count(x.device.index or 0)) if x.is_cuda else 1
    y, u, r, q = _outputs(M, N, block, x.device, write_fp8, save)
    has_scales = x_scale_inv is not None
    sx = scale_vector(x_scale_inv) if has_scales else y
    sw = scale_vector(w_scale_inv) if has_scales else y
    ws = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), N // block, split_k)
    kernel, meta = fixed_or_autotuned(_forward_kernel(K), config, {"BLOCK_M": 16, "BLOCK_K": 32})
    launcher(kernel, x)[grid](
        x, w, y, u, r, q, sx, sw, ws, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0),
        r.stride(0), M * N, NORM_EPS=eps, OUT_SCALE=static_fp8_scale(block), FP8_MAX_=FP8_MAX,
        HAS_SCALES=has_scales, WRITE_FP8=write_fp8, SAVE_FOR_BACKWARD=save, SPLIT_K=split_k, BLOCK_N=block,
        **pdl.launch_args(x), **meta)
    if split_k > 1:
        _launch_norm(ws[0], y, u, r, q, block, eps, write_fp8, save, splits=split_k)
    return _returned(y, u, r, q, write_fp8, save)


# The epilogue and dz kernels' programs: ~4K elements each (16 rows at B = 256: enough bytes in flight, no register
# spills) when that grid has at least SMALL_GRID_PER_SM programs per SM, else half as many rows on 8 warps (more,
# smaller programs in flight). On the H200 at M = 1024 the smaller programs took each of those kernels 0.15-0.74 µs
# faster at N <= 512 (1-2 norm blocks), and were slower at N >= 2048 (docs/kernels/README.md "Backward", Launch;
# ``benchmarks/sweep_memory_kernels.py``, which also measured the two warp counts below).
SMALL_GRID_PER_SM = 2
DZ_WARPS = 8  # the dz kernel's, whatever the grid: 0.45-0.75 µs faster than 4 warps at every shape without an
# FP8 cast, within 0.35 µs either way with one
CAST_ROWS, CAST_WARPS = 16, 8  # the rowwise cast of dz (no fold): up to 0.19 µs faster than 4 warps but at
# N = 7680 (0.33 µs slower)


def _rows_per_program(block: int) -> int:
    """The epilogue and dz kernels' rows per program on a grid that fills the GPU: ~4K elements a tile."""
    return max(1, 4096 // block)


def launch_shape(M: int, N: int, block: int, num_sms: Optional[int]) -> tuple[int, int]:
    """(rows per program, warps) of the epilogue (norm) and dz kernels on an (M, N) tensor on a GPU of ``num_sms``
    SMs (None: not a GPU, e.g. the interpreter: the full-grid shape)."""
    rows = _rows_per_program(block)
    if num_sms is not None and -(-M // rows) * (N // block) < SMALL_GRID_PER_SM * num_sms:
        return max(1, rows // 2), 8
    return rows, 4


def _launch_shape(t: torch.Tensor, block: int) -> tuple[int, int]:
    """``launch_shape`` for the (M, N) tensor ``t`` on its device."""
    return launch_shape(*t.shape, block, sm_count(t.device.index or 0) if t.is_cuda else None)


def _dz_grid(dy: torch.Tensor, block: int) -> tuple[tuple[int, int], int]:
    """(grid, rows per program) of the dz kernel on dy (M, N): row tiles x norm blocks."""
    M, N = dy.shape
    rows = _launch_shape(dy, block)[0]
    return (-(-M // rows), N // block), rows


def norm_forward(z: torch.Tensor, *, block: int = DEFAULT_BLOCK, eps: float = DEFAULT_EPS,
                 write_fp8: bool = False, save: bool = True, row_scale: Optional[torch.Tensor] = None,
                 col_scale: Optional[torch.Tensor] = None, save_z: bool = False):
    """z (M, N) (row stride free, unit column stride), or contiguous (S, M, N) partial sums (z = their sum,
    e.g. ``cublas_split_k``'s) -> (h, u, r, q) as ``fused_forward``. ``row_scale`` (M,)/(M, 1) with
    ``col_scale`` (N,)/(N, 1) fp32: the epilogue normalizes z·row_scale·col_scale (an FP8 GEMM run with unit
    scales, its operands' rowwise scales applied here). ``save_z``: the second output is z (M, N) bf16 before the
    scales (z itself, or the sum of its slices) instead of u, for ``backward_dz(from_z=True)``: one (M, N) write
    fewer when z is already in memory."""
    splits = 1
    if z.dim() == 3:
        assert z.is_contiguous(), z.stride()
        splits, z = z.shape[0], z[0]
    M, N = z.shape
    assert z.stride(1) == 1 and N % block == 0, (z.stride(), N, block)
    save_z = save and save_z
    y, u, r, q = _outputs(M, N, block, z.device, write_fp8, save, save_u=not save_z or splits > 1)
    scales = None if row_scale is None else (row_scale, col_scale)
    _launch_norm(z, y, u, r, q, block, eps, write_fp8, save, splits=splits, scales=scales, save_z=save_z)
    if save_z and splits == 1:
        assert z.dtype == torch.bfloat16, z.dtype
        u = z
    return _returned(y, u, r, q, write_fp8, save)


def _launch_norm(z, y, u, r, q, block: int, eps: float, write_fp8: bool, save: bool, splits: int = 1,
                 scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None, save_z: bool = False):
    """The epilogue kernel on z (M, N), or on the sum of ``splits`` contiguous (M, N) slices starting at z;
    ``scales`` (row (M,), column (N,)) multiply z first; ``save_z``: u is not written (with ``splits`` > 1 the
    summed z is, into u)."""
    triton, _, kernel, _ = _kernels()
    M, N = z.shape
    rows, warps = _launch_shape(z, block)
    sx, sw = (scale_vector(s) for s in scales) if scales is not None else (z, z)
    launcher(kernel, z)[(triton.cdiv(M, rows), N // block)](
        z, sx, sw, y, u, r, q, M, z.stride(0), M * N, y.stride(0), r.stride(0), NORM_EPS=eps,
        OUT_SCALE=static_fp8_scale(block), FP8_MAX_=FP8_MAX, WRITE_FP8=write_fp8, SAVE_FOR_BACKWARD=save,
        SAVE_Z=save_z, SPLITS=splits, HAS_SCALES=scales is not None, BLOCK_N=block, BLOCK_M=rows, num_warps=warps,
        **pdl.launch_args(z))


# the dz kernel stores its tile maxima (for a tensorwise amax) when there are at most this many: each program of
# the kernel that reads them takes their max (``max_of``); with more, one atomic max into a zeroed scalar
MAX_TILE_MAXIMA = 4096


def _tensorwise_amax(grid: tuple[int, int], device) -> torch.Tensor:
    """Where the dz kernel on ``grid`` puts a tensorwise amax: one slot per program (TILE_MAXIMA; written, never
    read before), or a zeroed () scalar for atomic maxima."""
    tiles = grid[0] * grid[1]
    if tiles <= MAX_TILE_MAXIMA:
        return torch.empty(tiles, dtype=torch.float32, device=device)
    return torch.zeros((), dtype=torch.float32, device=device)


def _launch_dz(dz_kernel, grid, dy, u, r, dz, block: int, rows: int, z_src: tuple, amax=None,
               amax_mode: int = 0, fold: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """The dz kernel: dz (M, N) from dy, u (or z: ``z_src`` = (from_z, z_row_scale, z_col_scale), as
    ``backward_dz`` takes them), r; ``amax_mode`` as bwd_dz_kernel's AMAX into ``amax``; ``fold`` (sx (M,) fp32,
    fold_amax from ``_tensorwise_amax``): also max |dz·sx| into fold_amax."""
    from_z, z_row_scale, z_col_scale = z_src
    z_scales = from_z and z_row_scale is not None
    sx, fold_amax = fold if fold is not None else (dz, dz)
    tensorwise = amax if amax_mode == 2 else fold_amax if fold is not None else None  # both alike if both
    zs_row, zs_col = (scale_vector(z_row_scale), scale_vector(z_col_scale)) if z_scales else (r, r)
    launcher(dz_kernel, dy)[grid](
        dy, u, r, zs_row, zs_col, dz, amax if amax is not None else dz, sx, fold_amax, dy.shape[0], dy.stride(0),
        u.stride(0), r.stride(0), dz.stride(0), amax.stride(0) if amax_mode == 1 else 0, FROM_Z=from_z,
        Z_SCALES=z_scales, AMAX=amax_mode, FOLD=fold is not None,
        TILE_MAXIMA=tensorwise is not None and tensorwise.dim() == 1, BLOCK_N=block, BLOCK_M=rows, num_warps=DZ_WARPS,
        **pdl.launch_args(dy))


def _fold_inputs(fold_sx: Optional[torch.Tensor], grid: tuple[int, int], device
                 ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(sx (M,) fp32 contiguous, where the dz kernel on ``grid`` puts max |dz·sx|) for a folded weight grad, or
    None."""
    if fold_sx is None:
        return None
    return scale_vector(fold_sx), _tensorwise_amax(grid, device)


def backward_dz(dy: torch.Tensor, u: torch.Tensor, r: torch.Tensor, *, block: int = DEFAULT_BLOCK,
                from_z: bool = False, z_row_scale: Optional[torch.Tensor] = None,
                z_col_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dy (M, N), u (M, N) bf16, r (M, NB) fp32 -> dz (M, N) bf16 (the gradient w.r.t. z = x·Wᵀ). ``from_z``: u
    holds z as ``norm_forward(save_z=True)`` kept it, u = z·r per norm block; with z_row_scale (M,)/(M, 1) and
    z_col_scale (N,)/(N, 1) fp32 (an FP8 GEMM run with unit scales) u = z·row·col·r."""
    kernel = _kernels()[3]
    dy = rows_contiguous(dy)
    dz = torch.empty(dy.shape, dtype=torch.bfloat16, device=dy.device)
    grid, rows = _dz_grid(dy, block)
    _launch_dz(kernel, grid, dy, u, r, dz, block, rows, (from_z, z_row_scale, z_col_scale))
    return dz


FOLD_ROWS = 64  # the rowwise cast kernel's rows per program when it also writes (dz·sx)ᵀ: 64-byte runs of it


def _dz_and_rowwise_e4m3(dz_kernel, grid, dy, u, r, dz, block: int, rows: int, z_src: tuple, fold_sx=None):
    """dz kernel writing each (row, block) amax, then one cast kernel (row amax from that small buffer); with
    ``fold_sx`` the cast kernel also writes the folded weight grad's (dz·sx)ᵀ e5m2 (wgrad_fold)."""
    triton = _kernels()[0]
    M, N = dy.shape
    nb = N // block
    amax = torch.empty((M, nb), dtype=torch.float32, device=dy.device)
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=dy.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=dy.device)
    fold = _fold_inputs(fold_sx, grid, dy.device)
    _launch_dz(dz_kernel, grid, dy, u, r, dz, block, rows, z_src, amax, 1, fold)
    if fold is None:
        sx, fold_amax, qt, st, q_rows = dz, dz, q, s, CAST_ROWS
    else:
        (sx, fold_amax), q_rows = fold, FOLD_ROWS
        qt = torch.empty((N, M), dtype=DZ_DTYPE, device=dy.device)
        st = torch.empty((), dtype=torch.float32, device=dy.device)
    launcher(_quant_kernel(), dy)[(triton.cdiv(M, q_rows), nb)](
        dz, amax, q, s, sx, fold_amax, qt, st, M, nb, dz.stride(0), amax.stride(0), q.stride(0),
        fold_amax.numel() if fold is not None else 0, FP8_MAX_=FP8_MAX, EPS_=EPS, NB_P2=triton.next_power_of_2(nb),
        FOLD=fold is not None, FOLD_FP8_MAX=float(torch.finfo(DZ_DTYPE).max), BLOCK_N=block, BLOCK_M=q_rows,
        num_warps=8 if fold is not None else CAST_WARPS, **pdl.launch_args(dy))
    return q, s, (qt, st) if fold is not None else None


def _dz_and_tensorwise_e5m2(dz_kernel, grid, dy, u, r, dz, block: int, rows: int, z_src: tuple,
                            fold_sx=None):
    """dz kernel writing its tile maxima (``_tensorwise_amax``), then the tensorwise cast pass (reads dz once);
    with ``fold_sx`` the dz kernel also finds max |dz·sx| and one more pass writes (dz·sx)ᵀ (wgrad_fold)."""
    from loka_trainer.kernels.triton_quant_tensorwise import cast_with_amax
    amax = _tensorwise_amax(grid, dy.device)
    fold = _fold_inputs(fold_sx, grid, dy.device)
    _launch_dz(dz_kernel, grid, dy, u, r, dz, block, rows, z_src, amax, 2, fold)
    q, s = cast_with_amax(dz, amax, torch.float8_e5m2)
    return q, s, (fold_dz_with_amax(dz, *fold) if fold is not None else None)


# granularity -> (fp8 dtype, launcher): the numerics of the torch._scaled_mm backend of that granularity for a
# gradient operand (rowwise: e4m3, cuBLASLt's rowwise kernels take no e5m2; tensorwise: e5m2)
DZ_FP8 = {
    "rowwise": (torch.float8_e4m3fn, _dz_and_rowwise_e4m3),
    "tensorwise": (torch.float8_e5m2, _dz_and_tensorwise_e5m2),
}


def backward_dz_fp8(dy: torch.Tensor, u: torch.Tensor, r: torch.Tensor, *, block: int = DEFAULT_BLOCK,
                    write_bf16: bool = True, granularity: str = "rowwise", fold_sx: Optional[torch.Tensor] = None,
                    from_z: bool = False, z_row_scale: Optional[torch.Tensor] = None,
                    z_col_scale: Optional[torch.Tensor] = None):
    """dy (M, N), u (M, N) bf16, r (M, NB) fp32 -> (dz_q (M, N) fp8, scale_inv fp32, dz (M, N) bf16 or None,
    folded or None): dz as ``backward_dz``, quantized exactly as ``quant.quantize(dz_bf16, granularity,
    DZ_FP8[granularity][0])``: rowwise e4m3 with scale_inv (M, 1), or tensorwise e5m2 with scale_inv ()
    (``mods.ops_fp8.mods_bwd_dz_fp8`` validates ``granularity``). ``fold_sx`` (M, 1) fp32, the forward's row scales of
    x: also ``folded`` = (dzt (N, M) e5m2, scale_inv ()), the folded weight grad's dz operand
    (``wgrad_fold.fold_operands_ref``'s first two). ``from_z``, ``z_row_scale``, ``z_col_scale`` as
    ``backward_dz``'s."""
    dz_kernel = _kernels()[3]
    dy = rows_contiguous(dy)
    dz = torch.empty(dy.shape, dtype=torch.bfloat16, device=dy.device)  # written either way: the cast reads it
    grid, rows = _dz_grid(dy, block)
    q, s, folded = DZ_FP8[granularity][1](dz_kernel, grid, dy, u, r, dz, block, rows,
                                          (from_z, z_row_scale, z_col_scale), fold_sx)
    return q, s, (dz if write_bf16 else None), folded
