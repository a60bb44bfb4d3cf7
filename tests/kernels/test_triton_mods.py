"""Which layers the fused Mods kernels accept (the interpreter cases are in interp_cases.py)."""
from __future__ import annotations

import pytest

from loka_trainer.kernels import triton_mods


@pytest.mark.parametrize("K,N,block,ok", [(32, 512, 256, True), (30, 512, 256, False), (32, 500, 256, False),
                                          (32, 96, 48, False), (32, 512, 512, False)])
def test_supports(K, N, block, ok):
    assert triton_mods.supports(K, N, block) is ok


@pytest.mark.parametrize("M, N, K, num_sms, split", [
    (1024, 256, 7680, 132, 8),   # 16 programs, long K: eight slices fill 128 of 132 SMs
    (1024, 512, 7680, 132, 4),   # 32 programs
    (1024, 2048, 4096, 132, 1),  # 128 programs: a wave already
    (1024, 256, 256, 132, 1),    # short K: a slice would be under MIN_K_PER_SPLIT
    (1024, 256, 1536, 132, 2),   # K / 4 = 384 < 512: two slices only
    (16, 256, 7680, 132, 8),     # one row tile: capped at MAX_SPLIT_K
])
def test_split_k_for(M, N, K, num_sms, split):
    from loka_trainer.kernels.triton_mods import split_k_for
    assert split_k_for(M, N, K, 256, num_sms) == split
