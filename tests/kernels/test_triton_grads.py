"""The grouped backward GEMMs (``triton_grads``) off-GPU: where they apply, what the kernel compiles to for sm90
(offline: Triton compiles for an H100/H200 target without a GPU). Numerics and the layer's backward routing:
interp_cases.py (CPU interpreter) and test_triton_grads_gpu.py."""
from __future__ import annotations

import pytest

from loka_trainer.mods import triton_grads
from tests.kernels.sm90 import SM90_SHARED_BYTES, compile_sm90


def test_applies_only_to_small_layers():
    assert triton_grads.applies(1024, 256, 256) and triton_grads.applies(1024, 512, 512)
    assert not triton_grads.applies(1024, 7680, 256) and not triton_grads.applies(1024, 256, 7680)
    assert not triton_grads.applies(0, 256, 256)


GRADS_TYPES = {n: "*bf16" for n in ("dz_ptr", "x_ptr", "w_ptr", "dx_ptr", "dw_ptr")}


def test_kernel_compiles_for_sm90_without_spills_and_waits_for_the_previous_grid():
    pytest.importorskip("triton")
    from loka_trainer.mods.triton_grads_kernels import configs, grads_kernel
    for config in configs:
        compiled = compile_sm90(grads_kernel.fn, GRADS_TYPES, {"PDL": True, **config.kwargs},
                                num_warps=config.num_warps, num_stages=config.num_stages)
        ptx = compiled.asm["ptx"]
        assert "ld.local" not in ptx and "st.local" not in ptx, config  # no register spills
        assert "mma" in ptx, config  # tensor-core MMAs (wgmma where a tile has >= 64 rows)
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), config
        assert compiled.metadata.shared <= SM90_SHARED_BYTES, config
