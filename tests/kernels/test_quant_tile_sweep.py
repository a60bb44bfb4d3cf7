"""benchmarks/sweep_quant_tiles off the GPU: the tiles it tries and the weight-grad arithmetic it reports (the
interpreter case in interp_cases.py checks that every tile quantizes like the shipped one)."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("R, C, row_major", [(8192, 4096, True), (4096, 8192, False), (8192, 32768, True),
                                             (16384, 8192, False), (40, 72, True)])
def test_quant_tile_sweep_starts_from_the_shipped_tile_and_keeps_every_tile_on_chip(R, C, row_major):
    pytest.importorskip("triton")
    from benchmarks.sweep_quant_tiles import (MAX_PER_THREAD, ONE_PASS_MAX_ELEMENTS, candidate_tiles, moved_bytes,
                                              tile_name)
    from loka_trainer.kernels.triton_quant import _tile
    tiles = candidate_tiles(R, C, row_major)
    assert tiles[0] == _tile(R, C, row_major) and len(set(tiles)) == len(tiles)
    assert len({tile_name(t) for t in tiles}) == len(tiles)
    for rows, cols, one_pass, warps in tiles[1:]:
        if one_pass:  # whole rows, within the register budget
            assert cols >= C and rows * cols <= ONE_PASS_MAX_ELEMENTS and rows * cols <= MAX_PER_THREAD * 32 * warps
        else:  # a transposed view is read at least one 32-byte sector (16 bf16) along its contiguous dim
            assert cols < max(C, 2) * 2 and (row_major or rows >= 16)
    if not row_major and C <= 8192:  # a few rows held whole: the one-pass tiles that share sectors through L2
        assert any(one_pass and rows <= 4 for rows, _, one_pass, _ in tiles)
    assert moved_bytes(R, C) == 3 * R * C + 4 * R


def test_quant_tile_sweep_weighs_a_weight_grad_gemm_with_both_transposed_quantizations():
    from benchmarks.sweep_quant_tiles import weight_grad_outlook

    def row(R, C, shipped, best, layout="transposed"):
        return {"R": R, "C": C, "layout": layout, "shipped_us": shipped, "best_us": best}
    # dyᵀ (N, M) = (16384, 8192) and xᵀ (K, M) = (4096, 8192); a row-major row of the same size must not be used
    rows = [row(16384, 8192, 300.0, 150.0), row(4096, 8192, 80.0, 40.0), row(4096, 8192, 1.0, 1.0, "row-major")]
    out = weight_grad_outlook(8192, 4096, 16384, rows, bf16_us=1000.0, fp8_gemm_us=600.0)
    assert out["quant_shipped_us"] == 380.0 and out["quant_best_us"] == 190.0
    assert out["speedup_shipped"] == pytest.approx(1000 / 980) and out["speedup_best"] == pytest.approx(1000 / 790)
    assert weight_grad_outlook(8192, 32768, 2048, rows, bf16_us=1.0, fp8_gemm_us=1.0) is None  # not swept
