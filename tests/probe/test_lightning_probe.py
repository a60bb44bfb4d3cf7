"""The probe inside PyTorch Lightning through the foundation's LightningAdapter."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

from loka_trainer.callbacks.lightning import LightningAdapter  # noqa: E402
from loka_trainer.callbacks.probe import ProbeCallback  # noqa: E402
from loka_trainer.probe.stats_io import load_stats  # noqa: E402


class TinyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_probe_runs_inside_lightning(tmp_path):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 8)), batch_size=10)
    probe = ProbeCallback(interval=2, save_interval=4, tensorboard=False)
    trainer = pl.Trainer(max_steps=8, callbacks=[LightningAdapter(probe, run_dir=tmp_path)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(TinyModule(), data)
    stats = load_stats(tmp_path / "probe")
    assert set(stats["layers"]) == {"net.0", "net.2"}
    assert float(stats["layers"]["net.0"]["activation"]["count"]) == 4 * 10  # global steps 0, 2, 4, 6
