from __future__ import annotations

import torch
from torch import nn

from loka_trainer.bench.plugins import Job
from loka_trainer.bench.preprocessors import Precision
from loka_trainer.bench.tree import ModuleInputs
from loka_trainer.kernels.linear import LoKALinear


class _Ctx:
    device = torch.device("cpu")


def test_fp8_precision_profiles_a_dispatch_converted_copy_and_leaves_the_model_alone(monkeypatch):
    # On a CPU no FP8 GEMM is faster than BF16, so let Dispatch pick FP8 wherever it is accurate enough:
    # only layers with an FP8 GEMM become LoKALinear.
    from loka_trainer.dispatch import measure as dispatch
    monkeypatch.setattr(dispatch, "select_backend", lambda cands, bf16_time_us, *, mere_threshold, **_: next(
        (n for n, c in cands.items() if n == "scaled_mm_rowwise" and c["mere"] < mere_threshold), "bf16"))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    x = torch.randn(32, 64)
    job = Job(path="model", module=mlp, inputs=ModuleInputs((x,), {}), batch_size=32)
    out = Precision("fp8").apply(job, _Ctx())
    converted = [m for m in out.module.modules() if isinstance(m, LoKALinear)]
    assert len(converted) == 2
    assert not any(isinstance(m, LoKALinear) for m in mlp.modules())
    assert any("GEMMs in FP8" in n for n in out.notes)
    with out.context():
        y = out.inputs.call(out.module)
    torch.testing.assert_close(y.float(), mlp(x), rtol=0.1, atol=0.05)
