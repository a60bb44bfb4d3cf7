"""Programmatic dependent launch: the launch keywords per device, and what they compile to on sm90
(offline: Triton compiles for an H100/H200 target without a GPU)."""
import pytest
import torch

from loka_trainer.kernels import pdl
from tests.kernels.sm90 import compile_sm90


def test_no_pdl_off_cuda():
    assert pdl.launch_args(torch.zeros(4, 4)) == {"PDL": False}  # no launch_pdl keyword at all


def test_on_for_sm90_devices_only(monkeypatch):
    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    assert pdl.launch_args(FakeCuda()) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_supported", lambda index: False)  # before Hopper: never
    assert not pdl.active(FakeCuda())


def test_off_for_a_traced_launch(monkeypatch):
    # a triton_op's body traced by torch.compile sees fake tensors: inductor launches that kernel, without PDL
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    with FakeTensorMode():
        t = torch.empty(4, 4, device="cuda")
    assert t.is_cuda and pdl.launch_args(t) == {"PDL": False}


@pytest.mark.parametrize("on", [False, True])
def test_the_kernels_wait_for_the_previous_grid_only_when_launched_with_pdl(on):
    pytest.importorskip("triton")
    from loka_trainer.kernels.triton_quant_kernels import quant_rowwise_kernel as kernel
    consts = {"FP8_MAX": 448.0, "EPS_": 1e-12, "ROWS": 4, "COLS": 256, "SINGLE_PASS": True, "PDL": on}
    types = {"t_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    compiled = compile_sm90(kernel, types, consts, pdl=on)
    ptx = compiled.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == on
    if on:  # before the kernel's first global load (predicated or not)
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
