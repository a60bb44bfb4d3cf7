"""Which layers the fused Mods kernels accept (the interpreter cases are in interp_cases.py)."""
from __future__ import annotations

import pytest

from loka_trainer.mods import shapes, triton_mods


@pytest.mark.parametrize("K,N,block,ok", [(32, 512, 256, True), (30, 512, 256, False), (32, 500, 256, False),
                                          (32, 96, 48, False), (32, 512, 512, False)])
def test_supports(K, N, block, ok):
    assert shapes.supports(K, N, block) is ok


@pytest.mark.parametrize("M, N, K, num_sms, split", [
    (1024, 256, 7680, 132, 8),   # 16 programs, long K: eight slices fill 128 of 132 SMs
    (1024, 512, 7680, 132, 4),   # 32 programs
    (1024, 2048, 4096, 132, 1),  # 128 programs: a wave already
    (1024, 256, 256, 132, 1),    # short K: a slice would be under MIN_K_PER_SPLIT
    (1024, 256, 1536, 132, 2),   # K / 4 = 384 < 512: two slices only
    (16, 256, 7680, 132, 8),     # one row tile: capped at MAX_SPLIT_K
])
def test_split_k_for(M, N, K, num_sms, split):
    from loka_trainer.mods.triton_mods import split_k_for
    assert split_k_for(M, N, K, 256, num_sms) == split


@pytest.mark.parametrize("M, N, num_sms, shape", [
    (1024, 256, 132, (8, 8)),    # 64 programs of 16 rows: under two a SM, so 8 rows on 8 warps
    (1024, 512, 132, (8, 8)),    # 128
    (1024, 2560, 132, (16, 4)),  # 640: the full-grid shape
    (1024, 512, 32, (16, 4)),    # the same layer on a GPU of 32 SMs fills it
    (1024, 256, None, (16, 4)),  # not a GPU (the interpreter)
])
def test_launch_shape_halves_the_rows_of_a_small_grid(M, N, num_sms, shape):
    assert triton_mods.launch_shape(M, N, 256, num_sms) == shape


@pytest.mark.parametrize("C, rows, cols, single_pass, warps", [
    (256, 8, 256, True, 4), (512, 4, 512, True, 4), (4096, 1, 4096, True, 4), (7680, 1, 8192, True, 4),
    (9000, 8, 512, False, 8)])  # longer rows than SINGLE_PASS_MAX_COLS: two passes over 512-wide chunks
def test_rowwise_quantizer_tiles_row_major_rows(C, rows, cols, single_pass, warps):
    pytest.importorskip("triton")
    from loka_trainer.kernels.triton_quant import _tile
    assert _tile(1024, C, row_major=True) == (rows, cols, single_pass, warps)
    assert _tile(1024, C, row_major=False) == (16, min(256, cols), False, 8)  # a transposed view


def test_cublas_split_k_slices_sum_to_the_product():
    import torch
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(24, 96, generator=g).to(torch.bfloat16), torch.randn(40, 96, generator=g).to(torch.bfloat16)
    parts = triton_mods.cublas_split_k(x, w, 4)
    assert parts.shape == (4, 24, 40) and parts.dtype == torch.float32
    torch.testing.assert_close(parts[1], x[:, 24:48].float() @ w[:, 24:48].float().t())  # slice 1 = K 24..47
    torch.testing.assert_close(parts.sum(0), x.float() @ w.float().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("K, heuristic, split", [(7680, 8, 8), (7682, 8, 2), (4096, 1, 1)])
def test_cublas_split_k_for_divides_k(monkeypatch, K, heuristic, split):
    from types import SimpleNamespace
    monkeypatch.setattr(triton_mods, "split_k_for", lambda *args: heuristic)
    monkeypatch.setattr(triton_mods, "sm_count", lambda index: 132)
    x = SimpleNamespace(is_cuda=True, shape=(1024, K), device=SimpleNamespace(index=0))
    assert triton_mods.cublas_split_k_for(x, 256, 256) == split


def test_cublas_split_k_for_is_one_off_cuda():
    import torch
    assert triton_mods.cublas_split_k_for(torch.zeros(1024, 7680), 256, 256) == 1
