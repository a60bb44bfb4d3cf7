"""GPU-only: the fused Mods layer compiled. Its ops are ``triton_op``s, so inductor launches their Triton kernels from
its own generated code (no opaque custom-op call), without copying any input first and without an fp64 argument (a
float argument typed fp64 by inductor turns a kernel's math fp64), and the layer trains as it does eagerly.

Skipped without CUDA sm89+ and triton (FP8); on CPU, test_ops_traced.py traces the same ops as torch.compile does
and checks what inductor's mutation analysis takes each kernel to write.
"""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None
    or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA sm89+ and triton")

COPY = re.compile(r"^\s*[^#\s].*(\bclone\(|\.copy_\()")  # a clone or copy in generated code (not a comment)

# (mode, dgrad, wgrad) -> the kernels inductor must launch itself in one training step
CASES = {
    ("split_bf16", "bf16", "bf16"): ("norm_fwd_kernel", "bwd_dz_kernel"),
    ("fused_bf16", "bf16", "bf16"): ("fused_fwd_kernel", "bwd_dz_kernel"),
    ("fused_bf16", "bf16", "scaled_mm_tensorwise"): ("fused_fwd_kernel", "bwd_dz_kernel", "amax_kernel",
                                                     "cast_kernel"),
    ("split_bf16", "scaled_mm_rowwise", "bf16"): ("norm_fwd_kernel", "bwd_dz_kernel", "quant_rows_kernel"),
    ("split_fp8", "scaled_mm_rowwise", "scaled_mm_tensorwise"): ("quant_rowwise_kernel", "norm_fwd_kernel",
                                                                 "bwd_dz_kernel", "quant_rows_kernel"),
    ("fused_fp8", "scaled_mm_tensorwise", "bf16"): ("quant_rowwise_kernel", "fused_fwd_kernel", "bwd_dz_kernel",
                                                    "cast_kernel"),
}


def _step(layer, x):
    """One training step of ``layer`` on x: (output, dx, dW)."""
    layer.weight.grad = None
    x = x.detach().requires_grad_()
    y = layer(x)
    y.float().square().mean().backward()
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("M,K,N", [(1024, 512, 512), (2048, 1024, 2048)])
@pytest.mark.parametrize("kernels", list(CASES), ids=["-".join(k) for k in CASES])
def test_compiled_layer_launches_its_kernels_from_inductor_code_without_copies(kernels, M, K, N):
    from torch._inductor.utils import run_and_get_code

    from loka_trainer.mods.module import FusedLinearMods
    mode, dgrad, wgrad = kernels
    torch.manual_seed(0)
    layer = FusedLinearMods(K, N, mode=mode, dgrad=dgrad, wgrad=wgrad, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    eager = _step(layer, x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got, code = run_and_get_code(lambda: _step(compiled, x))
    source = "\n".join(code)
    missing = [name for name in CASES[kernels] if name not in source]
    assert not missing, missing  # each launched from inductor's code, not through an opaque op
    copies = [line.strip() for line in source.splitlines() if COPY.search(line)]
    assert not copies, copies[:8]
    fp64_args = re.findall(r"'(\w+)': 'fp64'", source)  # in a kernel's signature (triton_meta)
    assert not fp64_args, fp64_args
    for a, b in zip(got, eager):  # the autotuners may pick other tiles compiled: rounding, not math
        rel = float((a.double() - b.double()).norm() / b.double().norm())
        assert rel < 2e-2, rel
