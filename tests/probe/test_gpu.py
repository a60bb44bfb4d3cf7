"""CUDA-only checks: trackers on the GPU match the CPU, and kernel timing goes through triton's do_bench."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.callbacks.base import TrainState
from loka_trainer.callbacks.probe import ProbeCallback
from loka_trainer.probe.activation import ActivationTracker
from loka_trainer.probe.mere import median_time
from loka_trainer.probe.stats_io import load_stats
from loka_trainer.probe.weight import WeightTracker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_trackers_match_cpu():
    x = torch.randn(4096, 300) * torch.linspace(0.1, 30, 300) + 2
    cpu, gpu = ActivationTracker(300, max_full_covariance=256, covariance_block=128), \
        ActivationTracker(300, max_full_covariance=256, covariance_block=128)
    for chunk in x.split(1000):
        cpu.update(chunk)
        gpu.update(chunk.cuda())
    assert gpu.moments.scatter.is_cuda
    torch.testing.assert_close(gpu.moments.mean.cpu(), cpu.moments.mean, rtol=1e-5, atol=1e-5)
    scale = float(cpu.moments.scatter.abs().max())  # fp32 sums: error scales with the largest entry
    torch.testing.assert_close(gpu.moments.scatter.cpu(), cpu.moments.scatter, rtol=1e-4, atol=1e-5 * scale)


def test_callback_on_cuda_bf16_model_saves_cpu_stats(tmp_path):
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).cuda().bfloat16()
    probe = ProbeCallback(interval=2, save_interval=4, out_dir=str(tmp_path), tensorboard=False)
    state = TrainState(model=model, device=torch.device("cuda"))
    probe.on_train_start(state)
    for step in range(8):
        state.step = step
        probe.on_step_start(state)
        model(torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
        probe.on_step_end(state)
    probe.on_train_end(state)
    stats = load_stats(tmp_path)
    assert float(stats["layers"]["2"]["activation"]["count"]) == 4 * 1024
    assert stats["layers"]["2"]["weight"]["u"].device.type == "cpu"


def test_median_time_on_cuda_is_positive():
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    assert 0 < median_time(lambda a, b: a @ b.T, x, x) < 1.0


def test_weight_updates_on_cuda_match_cpu_and_never_sync_the_host():
    """Observed weights are folded in on a side stream and activations after the forward, with no host sync
    (observing must not stall the step), and the weights give the CPU tracker's statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 1200)).cuda()
    probe = ProbeCallback(interval=1, out_dir="unused", tensorboard=False)
    probe.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    observed = []
    state = TrainState(model=model, device=torch.device("cuda"))
    for step in range(6):
        state.step = step
        x = torch.randn(256, 96, device="cuda")
        observed.append({fqn: layer.module.weight.detach().cpu().clone() for fqn, layer in probe.layers.items()})
        # any host sync while observing raises (from the second observation: the first one allocates the state)
        torch.cuda.set_sync_debug_mode("error" if step > 0 else "default")
        try:
            probe.on_step_start(state)
            out = model(x)
            probe.on_after_forward(state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        probe.on_step_end(state)
    probe.close()
    for fqn, layer in probe.layers.items():
        cpu = WeightTracker(*layer.weight.shape, max_full_covariance=probe.config.max_full_weight_factor)
        for weights in observed:
            cpu.update(weights[fqn])
        assert layer.weight.mean.is_cuda and layer.weight.count == cpu.count == 6
        for name in ("mean", "u", "v"):  # normwise: the early factors are near-singular (eps-regularized), so
            # single small entries differ by more than rounding between the two devices' solvers
            gpu_value, cpu_value = getattr(layer.weight, name).cpu(), getattr(cpu, name)
            assert float((gpu_value - cpu_value).norm() / cpu_value.norm()) < 1e-6, name



def test_observed_steps_with_sampled_rows_and_tensorboard_never_sync_the_host(tmp_path):
    """Row sampling (the tracker's own CUDA generator), the spread weight observations and the TensorBoard scalars
    (copied to the host asynchronously) leave the host free to run ahead of the GPU."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 32)).cuda()
    probe = ProbeCallback(interval=2, sample_rows=128, run_dir=tmp_path)
    state = TrainState(model=model, device=torch.device("cuda"), run_dir=tmp_path)
    probe.on_train_start(state)
    for step in range(7):
        state.step = step
        guard = "error" if step >= 2 else "default"  # the first observation allocates the trackers' state
        torch.cuda.set_sync_debug_mode(guard)
        try:
            probe.on_step_start(state)
            out = model(torch.randn(1024, 96, device="cuda"))
            probe.on_after_forward(state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out.square().mean().backward()
        torch.cuda.set_sync_debug_mode(guard)
        try:
            probe.on_step_end(state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    probe.close()
    assert all(int(layer.activation.moments.count) == 4 * 128 for layer in probe.layers.values())  # steps 0 2 4 6
    events = EventAccumulator(str(tmp_path / "tensorboard" / "probe"))
    events.Reload()
    assert [e.step for e in events.Scalars("probe/0/act_std")] == [0, 2, 4, 6]
