"""The one-kernel BF16 backward (``triton_mods_bwd``) off-GPU: where it applies, and what its kernel compiles to
for sm90 (offline: Triton compiles for an H100/H200 target without a GPU). Numerics: interp_cases.py (CPU
interpreter) and test_mods_bwd_gpu.py."""
from __future__ import annotations

import pytest

from loka_trainer.kernels import triton_mods_bwd


def test_applies_only_to_small_supported_layers(monkeypatch):
    assert triton_mods_bwd.applies(1024, 256, 256, 256) and triton_mods_bwd.applies(1024, 512, 512, 256)
    assert not triton_mods_bwd.applies(1024, 7680, 256, 256)  # N·K above MAX_WEIGHT_ELEMENTS
    assert not triton_mods_bwd.applies(1024, 256, 384, 256)  # N not a multiple of the norm block
    assert not triton_mods_bwd.applies(0, 256, 256, 256)
    monkeypatch.setattr(triton_mods_bwd, "ENABLED", False)
    assert not triton_mods_bwd.applies(1024, 256, 256, 256)


def test_kernel_compiles_for_sm90_without_spills_and_waits_for_the_previous_grid():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loka_trainer.kernels.triton_mods_bwd_kernels import bwd_one_kernel
    config = max(bwd_one_kernel.configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_K"])
    consts = {"PDL": True, "BLOCK_N": 256, **config.kwargs}
    types = {"r_ptr": "*fp32", "ws_ptr": "*fp32", "count_ptr": "*i32",
             **{n: "*bf16" for n in ("dy_ptr", "u_ptr", "x_ptr", "w_ptr", "dx_ptr", "dw_ptr")}}
    names = bwd_one_kernel.fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(bwd_one_kernel.fn, signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": config.num_warps, "launch_pdl": True})
    except Exception as e:  # noqa: BLE001 - e.g. no ptxas in this triton install
        pytest.skip(f"cannot compile for sm90 here: {type(e).__name__}: {str(e)[:120]}")
    ptx = compiled.asm["ptx"]
    assert "ld.local" not in ptx and "st.local" not in ptx  # no register spills
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert "atom.global" in ptx and "red.global" in ptx  # the arrival count and the fp32 partial sums
