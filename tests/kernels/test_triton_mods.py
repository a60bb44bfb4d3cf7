"""Which layers the fused Mods kernels accept (the interpreter cases are in interp_cases.py)."""
from __future__ import annotations

import pytest

from loka_trainer.kernels import triton_mods


@pytest.mark.parametrize("K,N,block,ok", [(32, 512, 256, True), (30, 512, 256, False), (32, 500, 256, False),
                                          (32, 96, 48, False), (32, 512, 512, False)])
def test_supports(K, N, block, ok):
    assert triton_mods.supports(K, N, block) is ok
