"""The probe inside PyTorch Lightning through the foundation's LightningAdapter."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

from loka_trainer.callbacks.base import TrainState  # noqa: E402
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


def _fit(probe: ProbeCallback, *, accumulate: int, max_steps: int, run_dir, extra=()) -> TinyModule:
    """Fit TinyModule on 80 fixed rows in batches of 10 (the same module weights and data for every call)."""
    torch.manual_seed(0)
    module = TinyModule()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 8)), batch_size=10)
    trainer = pl.Trainer(max_steps=max_steps, accumulate_grad_batches=accumulate, logger=False,
                         callbacks=[LightningAdapter(probe, run_dir=run_dir), *extra], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=run_dir)
    trainer.fit(module, data)
    return module


def _peak_stashed_bytes(accumulate: int, run_dir) -> int:
    """The most bytes of layer inputs the probe holds at the end of any forward of a run observing every step."""
    probe = ProbeCallback(interval=1, save_interval=100, tensorboard=False)
    peak = [0]

    class Watch(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.net.register_forward_hook(lambda *args: peak.__setitem__(0, max(peak[0], sum(
                x.numel() * x.element_size() for layer in probe.layers.values() for x in layer.inputs))))

    _fit(probe, accumulate=accumulate, max_steps=2, run_dir=run_dir, extra=[Watch()])
    assert float(probe.layers["net.0"].activation.moments.count) == 2 * accumulate * 10  # every micro-batch
    return peak[0]


def test_probe_holds_one_micro_batch_of_inputs_under_gradient_accumulation(tmp_path):
    """accumulate_grad_batches=k: each micro-batch's inputs are folded before its backward, so what the probe holds
    is one micro-batch's inputs, whatever k is."""
    one = _peak_stashed_bytes(1, tmp_path / "k1")
    assert one == 10 * (8 + 16) * 4  # net.0's and net.2's fp32 inputs of one 10-row micro-batch
    assert _peak_stashed_bytes(4, tmp_path / "k4") == one


def _stash_all_reference(accumulate: int, *, interval: int, steps: int, sample_rows: int) -> ProbeCallback:
    """The probe driven by a plain loop that folds each observed step's inputs at its end: every micro-batch of an
    accumulated step observed, one call each, in order (Lightning's loss is divided by k, as here)."""
    torch.manual_seed(0)
    module = TinyModule()
    data = list(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 8)), batch_size=10))
    opt = module.configure_optimizers()
    probe = ProbeCallback(interval=interval, save_interval=1000, tensorboard=False, sample_rows=sample_rows,
                          out_dir="unused")
    state = TrainState(model=module)
    probe.attach(module)
    for step in range(steps):
        state.step = step
        probe.on_step_start(state)
        for (x,) in data[step * accumulate:(step + 1) * accumulate]:
            (module.training_step((x,), 0) / accumulate).backward()
        opt.step()
        opt.zero_grad()
        probe.on_step_end(state)
    return probe


@pytest.mark.parametrize("sample_rows", [0, 4])
def test_accumulated_probe_statistics_equal_folding_every_micro_batch_at_the_step_end(tmp_path, sample_rows):
    probe = ProbeCallback(interval=2, save_interval=1000, tensorboard=False, sample_rows=sample_rows)
    _fit(probe, accumulate=2, max_steps=4, run_dir=tmp_path)
    reference = _stash_all_reference(2, interval=2, steps=4, sample_rows=sample_rows)
    for fqn, layer in reference.layers.items():
        got = probe.layers[fqn].activation
        assert got.calls == layer.activation.calls == 2 * 2  # steps 0 and 2, two micro-batches each
        for name, want in layer.activation.state_dict().items():
            assert (torch.equal(got.state_dict()[name], want) if isinstance(want, torch.Tensor)
                    else got.state_dict()[name] == want), (fqn, name)


class CheckpointedModule(TinyModule):
    """TinyModule under activation checkpointing: the backward runs `net`'s forward again."""

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False).square().mean()


@pytest.mark.parametrize("module_cls", [TinyModule, CheckpointedModule])
def test_activation_checkpointing_recomputes_are_not_observed(tmp_path, module_cls):
    """The backward's recomputed forward sees the same inputs again; the probe folds each observed step's inputs
    once, so a checkpointed model learns the statistics the plain one does."""
    stats = {}
    for name, cls in (("plain", TinyModule), ("tested", module_cls)):
        torch.manual_seed(0)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 8)), batch_size=10)
        probe = ProbeCallback(interval=2, save_interval=100, tensorboard=False)
        trainer = pl.Trainer(max_steps=8, callbacks=[LightningAdapter(probe, run_dir=tmp_path / name)], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", default_root_dir=tmp_path / name)
        trainer.fit(cls(), data)
        stats[name] = {n: layer.activation.moments for n, layer in probe.layers.items()}
    for layer in ("net.0", "net.2"):
        assert float(stats["tested"][layer].count) == 4 * 10  # global steps 0, 2, 4, 6: once each
        torch.testing.assert_close(stats["tested"][layer].mean, stats["plain"][layer].mean)


class ValidatedModule(TinyModule):
    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", self.net(x).square().mean())


def test_validation_between_micro_batches_is_not_observed(tmp_path):
    """accumulate_grad_batches=2 with val_check_interval=3: Lightning validates after the first micro-batch of the
    second step, while the probe waits for that step's next forward. The validation rows (around 100, far from the
    training rows) stay out of the statistics, and the step's second micro-batch is still observed."""
    torch.manual_seed(0)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 8)), batch_size=10)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(100 + torch.randn(50, 8)), batch_size=10)
    probe = ProbeCallback(interval=1, save_interval=100, tensorboard=False)
    trainer = pl.Trainer(max_steps=4, accumulate_grad_batches=2, val_check_interval=3, num_sanity_val_steps=0,
                         callbacks=[LightningAdapter(probe, run_dir=tmp_path)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(ValidatedModule(), train, val)
    moments = probe.layers["net.0"].activation.moments
    assert float(moments.count) == 8 * 10  # every training micro-batch, no validation batch
    assert float(moments.mean.abs().max()) < 1.0  # training rows are N(0, 1); validation rows would pull it to ~40
