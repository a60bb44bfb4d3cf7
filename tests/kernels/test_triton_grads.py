"""The grouped backward GEMMs (``triton_grads``) off-GPU: where they apply, what the kernel compiles to for sm90
(offline: Triton compiles for an H100/H200 target without a GPU). Numerics and the layer's backward routing:
interp_cases.py (CPU interpreter) and test_triton_grads_gpu.py."""
from __future__ import annotations

import pytest

from loka_trainer.kernels import triton_grads


def test_applies_only_to_small_layers(monkeypatch):
    assert triton_grads.applies(1024, 256, 256) and triton_grads.applies(1024, 512, 512)
    assert not triton_grads.applies(1024, 7680, 256) and not triton_grads.applies(1024, 256, 7680)
    assert not triton_grads.applies(0, 256, 256)
    monkeypatch.setattr(triton_grads, "ENABLED", False)
    assert not triton_grads.applies(1024, 256, 256)


def test_kernel_compiles_for_sm90_without_spills_and_waits_for_the_previous_grid():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loka_trainer.kernels.triton_grads_kernels import configs, grads_kernel
    names = grads_kernel.fn.arg_names
    for config in configs:
        consts = {"PDL": True, **config.kwargs}
        signature = {n: "constexpr" if n in consts else ("*bf16" if n.endswith("_ptr") else "i32") for n in names}
        source = ASTSource(grads_kernel.fn, signature, constexprs={(names.index(n),): v for n, v in consts.items()})
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={
                "num_warps": config.num_warps, "num_stages": config.num_stages, "launch_pdl": True})
        except Exception as e:  # noqa: BLE001 - e.g. no ptxas in this triton install
            pytest.skip(f"cannot compile for sm90 here: {type(e).__name__}: {str(e)[:120]}")
        ptx = compiled.asm["ptx"]
        assert "ld.local" not in ptx and "st.local" not in ptx, config  # no register spills
        assert "mma" in ptx, config  # tensor-core MMAs (wgmma where a tile has >= 64 rows)
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global"), config
        assert compiled.metadata.shared <= 227 * 1024, config  # fits an H100/H200 SM's shared memory
