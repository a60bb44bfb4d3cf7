"""The Triton kernel of ``triton_quant`` (imports triton at module level: import this module lazily).

See ``triton_quant`` for the math and the tiling.
"""
import triton
import triton.language as tl

from loka_trainer.kernels.pdl_kernels import pdl_start


@triton.jit
def quant_rowwise_kernel(t_ptr, q_ptr, s_ptr, R, C, stride_tr, stride_tc, stride_qr,
                         FP8_MAX: tl.constexpr, EPS_: tl.constexpr, ROWS: tl.constexpr,
                         COLS: tl.constexpr, SINGLE_PASS: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < R
    if SINGLE_PASS:  # the tile holds whole rows (COLS >= C): read once, amax and cast from registers
        cols = tl.arange(0, COLS)
        mask = row_ok[:, None] & (cols[None, :] < C)
        t = tl.load(t_ptr + rows[:, None] * stride_tr + cols[None, :] * stride_tc, mask=mask,
                    other=0.0).to(tl.float32)
        # NOTE: same guard as quant.amax_to_scale: an all-zero row gets a finite scale and exact zeros.
        scale = FP8_MAX / tl.minimum(tl.maximum(tl.max(tl.abs(t), axis=1), EPS_), 3.4028234663852886e38)
        q = tl.minimum(tl.maximum(t * scale[:, None], -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for i in range(0, tl.cdiv(C, COLS)):
            cols = i * COLS + tl.arange(0, COLS)
            mask = row_ok[:, None] & (cols[None, :] < C)
            t = tl.load(t_ptr + rows[:, None] * stride_tr + cols[None, :] * stride_tc, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(t.to(tl.float32)), axis=1))
        scale = FP8_MAX / tl.minimum(tl.maximum(amax, EPS_), 3.4028234663852886e38)
        for i in range(0, tl.cdiv(C, COLS)):
            cols = i * COLS + tl.arange(0, COLS)
            mask = row_ok[:, None] & (cols[None, :] < C)
            t = tl.load(t_ptr + rows[:, None] * stride_tr + cols[None, :] * stride_tc, mask=mask, other=0.0)
            q = tl.minimum(tl.maximum(t.to(tl.float32) * scale[:, None], -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(s_ptr + rows, 1.0 / scale, mask=row_ok)


@triton.jit
def _tile(R, C, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    return rows, cols, (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def row_amax_kernel(t_ptr, amax_ptr, R, C, stride_tr, ROWS: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr):
    # amax (R, chunks): each row's max |t| over this program's COLS-wide chunk (no atomics, nothing to zero)
    pdl_start(PDL)
    rows, cols, mask = _tile(R, C, ROWS, COLS)
    t = tl.load(t_ptr + rows[:, None] * stride_tr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(amax_ptr + rows * tl.num_programs(1) + tl.program_id(1), tl.max(tl.abs(t), axis=1), mask=rows < R)


@triton.jit
def quant_rowwise_t_kernel(t_ptr, amax_ptr, q_ptr, qt_ptr, s_ptr, R, C, stride_tr, FP8_MAX: tl.constexpr,
                           EPS_: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                           PDL: tl.constexpr):
    # the row scales from row_amax_kernel's chunk maxima; q (R, C) and qt (C, R) = qᵀ from one read of the tile
    # (ROWS contiguous bytes of each qt row per store)
    pdl_start(PDL)
    rows, cols, mask = _tile(R, C, ROWS, COLS)
    chunks = tl.arange(0, CHUNKS_P2)
    n_chunks = tl.num_programs(1)
    a = tl.load(amax_ptr + rows[:, None] * n_chunks + chunks[None, :],
                mask=(rows[:, None] < R) & (chunks[None, :] < n_chunks), other=0.0)
    # NOTE: same guard as quant.amax_to_scale: an all-zero row gets a finite scale and exact zeros.
    scale = FP8_MAX / tl.minimum(tl.maximum(tl.max(a, axis=1), EPS_), 3.4028234663852886e38)
    t = tl.load(t_ptr + rows[:, None] * stride_tr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(t * scale[:, None], -FP8_MAX), FP8_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    tl.store(qt_ptr + cols[None, :] * R + rows[:, None], q, mask=mask)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + rows, 1.0 / scale, mask=rows < R)
