from __future__ import annotations

import torch
from torch import nn

from loka_trainer.bench.plugins import Job
from loka_trainer.bench.preprocessors import Precision
from loka_trainer.bench.tree import ModuleInputs
from loka_trainer.kernels.linear import LoKALinear


class _Ctx:
    device = torch.device("cpu")


def test_fp8_precision_profiles_a_dispatch_converted_copy_and_leaves_the_model_alone():
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
