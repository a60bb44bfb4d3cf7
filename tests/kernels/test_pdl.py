"""Programmatic dependent launch: the launch keywords per switch, and what each level compiles to on sm90
(offline: Triton compiles for an H100/H200 target without a GPU)."""
import pytest
import torch

from loka_trainer.kernels import pdl


def test_no_pdl_off_cuda_whatever_the_switches(monkeypatch):
    t = torch.zeros(4, 4)
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        assert pdl.level(t) == 0 and pdl.launch_args(t) == {"PDL": 0, "launch_pdl": False}


def test_levels_follow_the_switches_on_an_sm90_device(monkeypatch):
    class FakeCuda:
        is_cuda = True
        device = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    t = FakeCuda()
    assert pdl.launch_args(t) == {"PDL": 2, "launch_pdl": True}
    monkeypatch.setattr(pdl, "EARLY_TRIGGER", False)
    assert pdl.launch_args(t) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(t) == {"PDL": 0, "launch_pdl": False}
    monkeypatch.setattr(pdl, "_supported", lambda index: False)  # pre-Hopper: never
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.level(t) == 0


@pytest.mark.parametrize("level, wait, trigger", [(0, False, False), (1, True, False), (2, True, True)])
def test_each_level_compiles_to_its_grid_dependency_instructions_for_sm90(level, wait, trigger):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from loka_trainer.kernels.triton_quant_kernels import quant_rowwise_kernel as kernel
    consts = {"FP8_MAX": 448.0, "EPS_": 1e-12, "ROWS": 4, "COLS": 256, "SINGLE_PASS": True, "PDL": level}
    types = {"t_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "launch_pdl": level > 0})
    except Exception as e:  # noqa: BLE001 - e.g. no ptxas in this triton install
        pytest.skip(f"cannot compile for sm90 here: {type(e).__name__}: {str(e)[:120]}")
    ptx = compiled.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == wait
    assert ("griddepcontrol.launch_dependents" in ptx) == trigger
