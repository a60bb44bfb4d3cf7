"""The Probe names a layer as Dispatch does (``module_names.canonical_named_modules``): its statistics' layer names
are the plan's, for a model with a child of its own named ``module`` (as DDP names the model it wraps) too, with or
without DDP around it, so ``precision.probe_stats`` fits the model it was learned on."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loka_trainer import LoKAConfig, convert_to_loka
from loka_trainer.probe.report import main as report_main
from loka_trainer.probe.stats_io import load_stats
from tests.probe.test_report_to_dispatch import learn_probe_stats

STEPS = 2


class _Tower(nn.Module):
    """x (B, 64) -> (B, 64): a user's model whose first child is named ``module``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.module = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.head = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.module(x))


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-rank gloo process group in this process (DDP needs one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _probe_layers(model: nn.Module, out) -> set[str]:
    """The layer names of the statistics the Probe writes to ``out`` over a few steps of ``model``."""
    learn_probe_stats(model, torch.optim.SGD(model.parameters(), lr=0.01), out, steps=STEPS, interval=1)
    return set(load_stats(out)["layers"])


def _plan_layers(model: nn.Module, **config) -> set[str]:
    config = LoKAConfig(**{"mods": False, "min_features": 16, "min_speedup": 0.001, "compute_dtype": "float32",
                           "timing_rounds": 1, **config})
    plan = convert_to_loka(model, config, calibration_batch=torch.randn(32, 64), device=torch.device("cpu"),
                           log=lambda line: None)
    return set(plan.layers)


def test_a_child_named_module_keeps_its_name_in_the_probes_stats_and_the_dispatch_plan(tmp_path):
    """The Probe dropped a leading ``module.`` by its text: its stats named ``module.0`` ``0``, the plan did not,
    and Dispatch refused the report as one of another model."""
    assert _probe_layers(_Tower(), tmp_path / "probe") == _plan_layers(_Tower()) == {"module.0", "head"}
    assert report_main([str(tmp_path / "probe"), "--num-samples", "2", "--device", "cpu"]) == 0
    assert _plan_layers(_Tower(), probe_stats=str(tmp_path / "probe")) == {"module.0", "head"}


def test_a_ddp_model_gets_the_names_of_the_model_it_wraps(tmp_path, one_rank_group):
    ddp = nn.parallel.DistributedDataParallel
    assert _probe_layers(ddp(_Tower()), tmp_path / "probe") == _plan_layers(ddp(_Tower())) == {"module.0", "head"}
