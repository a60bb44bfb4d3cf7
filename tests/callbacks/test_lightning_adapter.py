from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

from loka_trainer.callbacks.base import Callback, TrainState  # noqa: E402
from loka_trainer.callbacks.lightning import LightningAdapter  # noqa: E402
from loka_trainer.callbacks.probe import ProbeCallback  # noqa: E402
from loka_trainer.probe.stats_io import load_stats  # noqa: E402


class Recorder(Callback):
    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.losses: list[float] = []
        self.restored = None

    def on_train_start(self, state: TrainState) -> None:
        self.events.append(("train_start", state.step))

    def on_step_start(self, state: TrainState) -> None:
        self.events.append(("step_start", state.step))

    def on_after_forward(self, state: TrainState) -> None:
        assert state.loss is not None and state.loss.requires_grad is False
        self.events.append(("after_forward", state.step))

    def on_after_backward(self, state: TrainState) -> None:
        assert any(p.grad is not None for p in state.model.parameters())
        self.events.append(("after_backward", state.step))

    def on_step_end(self, state: TrainState) -> None:
        self.losses.append(float(state.loss))
        self.events.append(("step_end", state.step))

    def on_train_end(self, state: TrainState) -> None:
        self.events.append(("train_end", state.step))

    def state_dict(self):
        return {"num_events": len(self.events)}

    def load_state_dict(self, state_dict):
        self.restored = state_dict


class TinyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(-1))
    return torch.utils.data.DataLoader(data, batch_size=8)


def test_adapter_fires_loka_events_in_lightning_order(tmp_path):
    rec = Recorder()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[LightningAdapter(rec)], enable_checkpointing=False)
    trainer.fit(TinyModule(), _loader())
    assert rec.events == [("train_start", 0),
                          ("step_start", 0), ("after_forward", 0), ("after_backward", 0), ("step_end", 0),
                          ("step_start", 1), ("after_forward", 1), ("after_backward", 1), ("step_end", 1),
                          ("step_start", 2), ("after_forward", 2), ("after_backward", 2), ("step_end", 2),
                          ("train_end", 2)]
    assert len(rec.losses) == 3 and all(v > 0 for v in rec.losses)


def test_adapter_fires_one_loka_step_per_accumulated_optimizer_step(tmp_path):
    rec = Recorder()
    trainer = pl.Trainer(max_steps=2, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[LightningAdapter(rec)], enable_checkpointing=False)
    trainer.fit(TinyModule(), _loader())
    micro_batch = lambda step: [("after_forward", step), ("after_backward", step)]  # noqa: E731
    assert rec.events == [("train_start", 0),
                          ("step_start", 0), *micro_batch(0), *micro_batch(0), ("step_end", 0),
                          ("step_start", 1), *micro_batch(1), *micro_batch(1), ("step_end", 1),
                          ("train_end", 1)]


class SavesSeen(ProbeCallback):
    def __init__(self, **fields):
        super().__init__(**fields)
        self.saved_at: list[int] = []

    def save(self, step: int) -> None:
        self.saved_at.append(step)
        super().save(step)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_probe_under_lightning_saves_each_step_once(tmp_path, accumulate):
    probe = SavesSeen(interval=1, save_interval=2, out_dir=str(tmp_path / "probe"), tensorboard=False)
    trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=accumulate, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[LightningAdapter(probe)], enable_checkpointing=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64)),
                                         batch_size=8)
    trainer.fit(TinyModule(), loader)
    assert probe.saved_at == [1, 3]
    assert load_stats(tmp_path / "probe")["step"] == 3


def test_adapter_round_trips_callback_state_through_lightning_checkpoint(tmp_path):
    rec = Recorder()
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[LightningAdapter(rec)])
    trainer.fit(TinyModule(), _loader())
    ckpt = next(tmp_path.rglob("*.ckpt"))
    rec2 = Recorder()
    trainer2 = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=tmp_path, callbacks=[LightningAdapter(rec2)])
    trainer2.fit(TinyModule(), _loader(), ckpt_path=str(ckpt))
    assert rec2.restored is not None and rec2.restored["num_events"] >= 7
    assert rec2.events[0] == ("train_start", 2)
