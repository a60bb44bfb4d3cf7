"""The Triton kernels of ``triton_quant_tensorwise`` (imports triton at module level: import this lazily).

t (R, C) any strides, tiled (BLOCK_R, BLOCK_C), one program per tile; see ``triton_quant_tensorwise`` for the math.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.pdl_kernels import pdl_start


@triton.jit
def _tile(R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # this program's (rows, cols, mask) on a 1-D grid over (row tile, column tile): a 2-D one caps its second axis
    # at 65535 tiles, which a transposed (64, 2**21) weight-grad operand exceeds. No pointer goes in: inductor's
    # mutation analysis takes a store address made from a call's results as one into every pointer of that call.
    tiles_c = tl.cdiv(C, BLOCK_C)
    rows = (tl.program_id(0) // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (tl.program_id(0) % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows, cols, (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def _load(t_ptr, rows, cols, mask, stride_r, stride_c):
    return tl.load(t_ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def max_of(amax_ptr, N_AMAX, CHUNK: tl.constexpr = 1024):
    # the max of N_AMAX fp32 values: one amax, or the tile maxima a kernel stored without atomics (no zeroed
    # scalar to set up, no serialized atomics at the end of that kernel)
    m = tl.full((CHUNK,), 0.0, tl.float32)
    for i in range(0, tl.cdiv(N_AMAX, CHUNK)):
        offs = i * CHUNK + tl.arange(0, CHUNK)
        m = tl.maximum(m, tl.load(amax_ptr + offs, mask=offs < N_AMAX, other=0.0))
    return tl.max(m)


@triton.jit
def amax_kernel(t_ptr, amax_ptr, R, C, stride_r, stride_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                PDL: tl.constexpr):
    pdl_start(PDL)
    rows, cols, mask = _tile(R, C, BLOCK_R, BLOCK_C)
    t = _load(t_ptr, rows, cols, mask, stride_r, stride_c)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(t)))  # a max: exact in any order


@triton.jit
def cast_kernel(t_ptr, amax_ptr, q_ptr, s_ptr, R, C, stride_r, stride_c, N_AMAX, FP8_MAX: tl.constexpr,
                EPS_: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    rows, cols, mask = _tile(R, C, BLOCK_R, BLOCK_C)
    t = _load(t_ptr, rows, cols, mask, stride_r, stride_c)
    # NOTE: same guard as quant.amax_to_scale: an all-zero tensor gets a finite scale and exact zeros.
    scale = tl.math.div_rn(FP8_MAX, tl.minimum(tl.maximum(max_of(amax_ptr, N_AMAX), EPS_), 3.4028234663852886e38))
    q = tl.minimum(tl.maximum(t * scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + rows[:, None] * C + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(s_ptr, 1.0 / scale)
