from __future__ import annotations

import pytest
import torch
from torchao.float8 import float8_utils

from loka_trainer.kernels.quant import (
    EPS, FP8_DTYPES, QUANTIZERS, amax_to_scale, dequantize, fake_quantize, fp8_dtype, quantize,
)

GRANULARITIES = sorted(QUANTIZERS)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Round-to-nearest relative error of a normal FP8 value is at most 2^-(mantissa bits + 1).
MAX_REL = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}


def _expected_scale_shape(granularity: str, m: int, k: int) -> tuple[int, ...]:
    g = -(-k // 128)
    return {"tensorwise": (), "rowwise": (m, 1), "colwise": (1, k), "block1x128": (m, g),
            "block128x128": (-(-m // 128), g)}[granularity]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(64, 256), (200, 300), (1, 130)])
def test_error_within_fp8_rounding_bound(granularity, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape) * torch.logspace(-2, 2, shape[1])  # columns spanning 4 decades
    q, scale_inv = quantize(x, granularity, dtype)
    assert q.dtype == dtype and q.shape == x.shape
    assert tuple(scale_inv.shape) == _expected_scale_shape(granularity, *shape)
    xr = dequantize(q, scale_inv)
    # Elements that stay normal in FP8 after scaling obey the rounding bound; tiny ones only an absolute one.
    tiny = torch.finfo(dtype).tiny
    normal = q.float().abs() >= 2 * tiny  # margin: values just below tiny may round up onto it
    rel = ((xr - x).abs() / x.abs())[normal]
    assert rel.max() <= MAX_REL[dtype] + 1e-6
    group_amax = x.abs().max()
    assert ((xr - x).abs() <= group_amax * 2.0 ** -3).all()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_finer_granularity_no_worse_with_row_outliers(granularity):
    torch.manual_seed(1)
    x = torch.randn(256, 256)
    x[3] *= 1e6  # one outlier row flushes every other row to zero under tensorwise scaling
    err = lambda g: ((fake_quantize(x, g) - x).abs() / x.abs().clamp_min(1e-6)).median().item()
    if granularity in ("rowwise", "block1x128"):
        assert err(granularity) < err("tensorwise") / 4


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("case", ["zeros", "zero_row", "huge", "subnormal", "mixed"])
def test_scales_finite_on_degenerate_input(granularity, dtype, case):
    x = torch.randn(130, 260)
    if case == "zeros":
        x.zero_()
    elif case == "zero_row":
        x[5] = 0.0
        x[:, 7] = 0.0
    elif case == "huge":
        x[0, 0] = 3.0e38
    elif case == "subnormal":
        x = torch.full((130, 260), 1e-40)
    else:
        x[0, 0], x[1, :] = 1e30, 1e-42
    q, scale_inv = quantize(x, granularity, dtype)
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()
    assert torch.isfinite(q.float()).all()
    xr = dequantize(q, scale_inv)
    assert torch.isfinite(xr).all()
    if case in ("zeros", "zero_row"):
        assert (xr[x == 0] == 0).all()


def test_amax_to_scale_clamps():
    s = amax_to_scale(torch.tensor([0.0, 1e-45, 1.0, float(torch.finfo(torch.float32).max)]), E4M3)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert s[2] == 448.0


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="valid"):
        quantize(torch.ones(4, 4), "per_channel")
    with pytest.raises(ValueError, match="e4m3"):
        fp8_dtype("e3m4")
    assert set(FP8_DTYPES) == {"e4m3", "e5m2"}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_amax_to_scale_is_the_correctly_rounded_quotient(dtype):
    # The Triton kernels divide fp8_max / amax in fp32 (exactly rounded in the interpreter); the reference must
    # give the same bits, not fp8_max * (1 / amax), which is rounded twice.
    amax = torch.exp(torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 100 - 25)  # 1e-11 .. 2e32
    exact = torch.full_like(amax, torch.finfo(dtype).max) / amax
    assert torch.equal(amax_to_scale(amax, dtype), exact)
    assert amax_to_scale(torch.tensor(float("inf")), dtype) > 0  # finite and non-zero for an inf amax
    assert EPS == float8_utils.EPS  # the Triton kernels clamp by ours
