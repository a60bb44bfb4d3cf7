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
        # div_rn: the correctly rounded quotient, as quant.amax_to_scale (torchao); Triton's `/` is approximate
        scale = tl.math.div_rn(FP8_MAX, tl.minimum(tl.maximum(tl.max(tl.abs(t), axis=1), EPS_), 3.4028234663852886e38))
        q = tl.minimum(tl.maximum(t * scale[:, None], -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for i in range(0, tl.cdiv(C, COLS)):
            cols = i * COLS + tl.arange(0, COLS)
            mask = row_ok[:, None] & (cols[None, :] < C)
            t = tl.load(t_ptr + rows[:, None] * stride_tr + cols[None, :] * stride_tc, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(t.to(tl.float32)), axis=1))
        scale = tl.math.div_rn(FP8_MAX, tl.minimum(tl.maximum(amax, EPS_), 3.4028234663852886e38))
        for i in range(0, tl.cdiv(C, COLS)):
            cols = i * COLS + tl.arange(0, COLS)
            mask = row_ok[:, None] & (cols[None, :] < C)
            t = tl.load(t_ptr + rows[:, None] * stride_tr + cols[None, :] * stride_tc, mask=mask, other=0.0)
            q = tl.minimum(tl.maximum(t.to(tl.float32) * scale[:, None], -FP8_MAX), FP8_MAX)
            tl.store(q_ptr + rows[:, None] * stride_qr + cols[None, :], q.to(q_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(s_ptr + rows, 1.0 / scale, mask=row_ok)
