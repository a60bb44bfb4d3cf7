from __future__ import annotations

import pytest
import torch

from loka_trainer.probe.flush import flushed_fraction, flushed_fraction_of

# The FP8 formats by definition: largest finite value and smallest subnormal. A value flushes when |x · scale|,
# scale = FMAX / amax of its group, is below half the smallest subnormal (it rounds to zero).
FORMATS = {torch.float8_e4m3fn: (448.0, 2.0 ** -9), torch.float8_e5m2: (57344.0, 2.0 ** -16)}


def _group_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """(M, K) -> (M, K) fp64: the amax of the scaling group each element belongs to (K a multiple of 128)."""
    a = x.double().abs()
    if granularity == "tensorwise":
        return a.max().expand_as(a)
    if granularity == "rowwise":
        return a.amax(dim=1, keepdim=True).expand_as(a)
    if granularity == "colwise":
        return a.amax(dim=0, keepdim=True).expand_as(a)
    assert granularity == "block1x128"
    m, k = a.shape
    return a.reshape(m, k // 128, 128).amax(dim=2, keepdim=True).expand(m, k // 128, 128).reshape(m, k)


def _expected(x: torch.Tensor, granularity: str, dtype: torch.dtype) -> float:
    fmax, smallest_subnormal = FORMATS[dtype]
    a = x.double().abs()
    flushed = (a > 0) & (a * fmax / _group_amax(x, granularity) < smallest_subnormal / 2)
    return int(flushed.sum()) / int((a > 0).sum())


def test_a_handmade_tensor():
    # amax 448: scale 1, so a value flushes below 2^-10 ~ 9.8e-4 (e4m3); the zero is not counted
    x = torch.tensor([[448.0, 1e-4, 1e-3, 0.0, -5e-4, 1.0]])
    assert flushed_fraction(x, "tensorwise") == pytest.approx(2 / 5)
    # e5m2: scale 57344 / 448 = 128, flushes below 2^-17 / 128 ~ 6e-8: nothing here
    assert flushed_fraction(x, "tensorwise", torch.float8_e5m2) == 0.0


def _outlier_operand(rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Standard normal with 2 channels at 100x and a few values spiked 1e3x (one of them in a hot channel)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x[:, [3, 200]] *= 100.0
    spikes = torch.rand(rows, cols, generator=gen) < 1e-3
    x[spikes] *= 1e3
    x[5, 3] = 3.0 * 100.0 * 1e3  # a 3-sigma value of a hot channel, spiked
    x[x.abs() < 0.05] = 0.0  # some exact zeros: they are not counted
    return x


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise", "colwise", "block1x128"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_matches_the_definition(granularity, dtype):
    x = _outlier_operand()
    assert flushed_fraction(x, granularity, dtype) == pytest.approx(_expected(x, granularity, dtype), rel=1e-6)


def test_one_scale_per_tensor_flushes_what_one_per_row_keeps():
    x = _outlier_operand()
    tensorwise, rowwise = flushed_fraction(x, "tensorwise"), flushed_fraction(x, "rowwise")
    assert tensorwise > 0.3  # the hot-channel spike sets the one scale
    assert rowwise < 0.05  # only the spiked rows lose their small values
    normal = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    assert flushed_fraction(normal, "tensorwise") < 1e-3


def test_bf16_operand_and_transposed_view():
    x = _outlier_operand().to(torch.bfloat16)
    assert flushed_fraction(x, "rowwise") == pytest.approx(_expected(x, "rowwise", torch.float8_e4m3fn), rel=1e-6)
    # the weight-grad layout xᵀ (K, M): rowwise is one scale per input channel
    assert flushed_fraction(x.t(), "rowwise") == pytest.approx(_expected(x, "colwise", torch.float8_e4m3fn), rel=1e-6)


def test_no_nonzero_value_flushes_nothing_and_shapes_must_match():
    assert flushed_fraction(torch.zeros(4, 16), "tensorwise") == 0.0
    x = torch.ones(2, 2)
    assert float(flushed_fraction_of(x, torch.zeros(2, 2, dtype=torch.float8_e4m3fn))) == 1.0
    with pytest.raises(ValueError, match="differ in shape"):
        flushed_fraction_of(x, torch.zeros(2, 3, dtype=torch.float8_e4m3fn))
