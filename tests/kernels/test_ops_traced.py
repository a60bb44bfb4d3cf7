"""The fused Mods layer's ``triton_op``s traced the way torch.compile traces them (AOTAutograd over fake tensors), on
the CPU: the Triton path forced and Triton's front end aimed at an sm90 target, so inductor's mutation analysis reads
every kernel as it does on the H200. Each kernel may be taken to write only buffers its op made itself, never a graph
input: a forward input taken as written fails to compile ("a leaf Variable that requires grad is being used in an
in-place operation") or is copied every step; an input's clone costs a copy.
"""
from __future__ import annotations

import pytest
import torch

# (mode, dgrad, wgrad): every op and kernel of the layer at least once
CASES = [
    ("fused_bf16", "bf16", "bf16"),  # grads_bf16 (dx and dW in one launch)
    ("fused_bf16", "bf16", "scaled_mm_tensorwise"),  # quant_tensorwise of dz and x in the backward
    ("split_bf16", "bf16", "scaled_mm_rowwise"),  # quant_rowwise of transposed operands
    ("split_bf16", "scaled_mm_rowwise", "bf16"),  # mods_bwd_dz_fp8, rowwise
    ("fused_fp8", "scaled_mm_tensorwise", "bf16"),  # mods_bwd_dz_fp8, tensorwise (tile maxima, cast)
    ("split_fp8", "scaled_mm_rowwise", "scaled_mm_tensorwise"),  # the folded weight grad behind a fused dgrad
    ("fused_fp8", "bf16", "scaled_mm_tensorwise_fast_accum"),  # wgrad_fold from the bf16 dz
]


@pytest.fixture
def sm90_frontend(monkeypatch):
    """Triton's front end compiling for sm90 without a GPU, and the layer taking its Triton path on CPU tensors."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from loka_trainer.kernels import triton_env

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", Sm90())  # the driver Triton asks for its target
    monkeypatch.setattr(triton_env, "interpreting", lambda: True)  # use_triton(t) for CPU tensors


def _base(node):
    """The graph node a view chain starts from."""
    from torch.fx.passes.reinplace import _is_view_op
    while node.op == "call_function" and _is_view_op(node.target):
        node = node.args[0]
    return node


@pytest.mark.parametrize("kernels", CASES, ids=["-".join(c) for c in CASES])
def test_traced_kernels_write_only_buffers_their_op_made(sm90_frontend, kernels):
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loka_trainer.mods.ops import linear_mods_fp8_out
    mode, dgrad, wgrad = kernels
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm)

    def layer(x, w):
        return linear_mods_fp8_out(x, w, block=256, mode=mode, dgrad=dgrad, wgrad=wgrad)[0]

    with FakeTensorMode():
        x = torch.empty(256, 512, dtype=torch.bfloat16).requires_grad_()
        w = torch.nn.Parameter(torch.empty(512, 512, dtype=torch.bfloat16))
        aot_function(layer, fw_compiler=keep, bw_compiler=keep)(x, w).float().sum().backward()
    assert len(graphs) == 2  # forward, backward
    launches, written_inputs = 0, []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.copy_.default and _base(node.args[0]).op == "placeholder":
                written_inputs.append(f"copy_ into {node.args[0]}")
            if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
                launches += 1
                kwargs = node.kwargs["kwargs"]
                written_inputs += [f"{name} = {kwargs[name]}" for name in node.kwargs["tensors_to_clone"]
                                   if _base(kwargs[name]).op == "placeholder"]
    assert launches >= 2  # the Triton kernels were traced, not skipped
    assert not written_inputs, written_inputs
