"""ProbeCallback in a plain user loop (the module docstring's recipe), filters, saving, TensorBoard, checkpoint."""
from __future__ import annotations

import threading

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import loka_trainer.callbacks.probe as probe_mod
from loka_trainer.callbacks.base import TrainState
from loka_trainer.callbacks.probe import ProbeCallback
from loka_trainer.callbacks.probe_config import ProbeConfig
from loka_trainer.callbacks.probe_layer import full_parameter
from loka_trainer.models.layers import TokenMix
from loka_trainer.probe.stats_io import AsyncSaver, load_stats

ROWS = 16


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), MyLinear(32, 16, bias=False), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.inner(x))


def test_tensorboard_events_stay_in_the_run_dir_when_the_stats_go_elsewhere(tmp_path):
    """An explicit out_dir holds the stats only: the events go to <run dir>/tensorboard/probe, which a fresh start
    moves aside with the run, not beside out_dir, where runs sharing its parent would pile them up."""
    probe = ProbeCallback(interval=2, save_interval=100, out_dir=str(tmp_path / "stats" / "probe"),
                          run_dir=tmp_path / "run")
    run_plain_loop(probe, steps=2)
    assert list((tmp_path / "run" / "tensorboard" / "probe").iterdir())
    assert sorted(p.name for p in (tmp_path / "stats").iterdir()) == ["probe"]


class MyLinear(nn.Linear):
    """Stands in for Float8Linear / LoKALinear: any nn.Linear subclass is a target."""


def run_plain_loop(probe: ProbeCallback, *, steps: int, model: nn.Module | None = None, seed: int = 0,
                   start: int = 0, end: bool = True) -> TrainState:
    """Steps [start, steps); ``end=False``: stops as a killed run does, without on_train_end."""
    torch.manual_seed(seed)
    model = model or Tower()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = TrainState(model=model, step=start)
    probe.on_train_start(state)
    for step in range(start, steps):
        state.step = step
        probe.on_step_start(state)
        loss = model(torch.randn(ROWS, 8)).square().mean()
        loss.backward(); opt.step(); opt.zero_grad()
        probe.on_step_end(state)
    if end:
        probe.on_train_end(state)
    return state


def test_plain_loop_observes_every_interval_and_writes_stats(tmp_path):
    probe = ProbeCallback(interval=5, save_interval=10, out_dir=str(tmp_path / "probe"), tensorboard=False)
    run_plain_loop(probe, steps=23)  # observed at 0, 5, 10, 15, 20; saved after 9, 19 and at the end (22)
    stats = load_stats(tmp_path / "probe")
    assert stats["step"] == 22 and set(stats["layers"]) == {"inner.0", "inner.2", "head"}
    layer = stats["layers"]["inner.2"]
    assert float(layer["activation"]["count"]) == 5 * ROWS
    # weights: layer i of 3 at steps where step % 5 == i * 5 // 3 (0, 1, 3), and every layer at step 0
    assert {fqn: entry["weight"]["count"] for fqn, entry in stats["layers"].items()} == {
        "inner.0": 5, "inner.2": 6, "head": 5}  # 0 5 10 15 20 | 0 1 6 11 16 21 | 0 3 8 13 18
    assert tuple(layer["weight"]["mean"].shape) == (16, 32)
    assert layer["has_bias"] is False and stats["layers"]["head"]["has_bias"] is True


def test_weight_observations_are_spread_over_the_interval(monkeypatch):
    """After the first observed step no step folds more than its share of the weights; a run shorter than the
    interval still has every layer's weight."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(10)])
    probe = ProbeCallback(interval=4, tensorboard=False, out_dir="unused")
    observed = []
    state = TrainState(model=model)
    probe.on_train_start(state)
    for layer in probe.layers.values():
        monkeypatch.setattr(layer, "observe_weight", lambda updates, layer=layer: (
            observed.append((state.step, layer.fqn)), setattr(layer.weight, "count", layer.weight.count + 1)))
    for step in range(8):
        state.step = step
        probe.on_step_start(state)
        model(torch.randn(2, 8))
        probe.on_step_end(state)
    per_step = [sum(1 for s, _ in observed if s == step) for step in range(8)]
    assert per_step[0] == 10 and max(per_step[1:]) <= 3 and sum(per_step[4:]) == 10  # ceil(10 / 4) per step
    assert {fqn for s, fqn in observed if s >= 4} == set(probe.layers)  # each layer once in steps 4..7


def test_hooks_stash_inputs_only_on_observed_steps():
    """One hook per layer for the whole run; it stashes inputs only while armed, and they are folded (and
    freed) after the forward."""
    probe = ProbeCallback(interval=3, save_interval=1000, tensorboard=False, out_dir="unused")
    model = Tower()
    state = TrainState(model=model)
    probe.attach(model)
    for step in range(7):
        state.step = step
        probe.on_step_start(state)
        assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 3
        model(torch.randn(4, 8))
        assert len(probe.layers["head"].inputs) == (1 if step % 3 == 0 else 0)
        probe.on_after_forward(state)
        assert not probe.layers["head"].inputs and not probe.layers["head"].armed
        probe.on_step_end(state)
    assert float(probe.layers["head"].activation.moments.count) == 3 * 4  # steps 0, 3, 6
    probe.close()
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_every_micro_batch_of_an_accumulated_observed_step_is_folded_after_its_forward():
    """k micro-batches per step, each followed by on_after_forward and on_after_backward: all k are observed (one
    call each), and after each forward's fold the stash is empty, so one micro-batch's inputs are held at a time."""
    probe = ProbeCallback(interval=2, save_interval=1000, tensorboard=False, out_dir="unused")
    model = Tower()
    state = TrainState(model=model)
    probe.attach(model)
    for step in range(4):
        state.step = step
        probe.on_step_start(state)
        for _ in range(3):
            loss = model(torch.randn(4, 8)).square().mean()
            assert len(probe.layers["head"].inputs) == (1 if step % 2 == 0 else 0)
            probe.on_after_forward(state)
            assert not any(layer.inputs for layer in probe.layers.values())
            loss.backward()
            probe.on_after_backward(state)
        probe.on_step_end(state)
        assert not any(layer.armed for layer in probe.layers.values())
    head = probe.layers["head"].activation
    assert float(head.moments.count) == 2 * 3 * 4 and head.calls == 2 * 3  # steps 0 and 2, 3 micro-batches each
    probe.close()


def test_filters_by_name_type_and_size():
    model = Tower()
    pick = lambda **kw: set(ProbeCallback(tensorboard=False, **kw).attach(model))  # noqa: E731
    assert pick(include=["inner.*"]) == {"inner.0", "inner.2"}
    assert pick(exclude=["head"]) == {"inner.0", "inner.2"}
    assert pick(module_types=["MyLinear"]) == {"inner.2"}
    assert pick(min_features=8) == {"inner.0", "inner.2"}  # head has out_features 1
    assert set(ProbeCallback(tensorboard=False, module_filter_fn=lambda m, fqn: m.bias is None).attach(model)) == {"inner.2"}


def test_the_readme_recipe_observes_the_fused_mods_layers_convert_to_loka_made(tmp_path):
    from loka_trainer import LoKAConfig, apply_mods, convert_to_loka
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.SiLU(), nn.Linear(256, 256), nn.LayerNorm(256),
                          nn.SiLU(), nn.Linear(256, 1))
    apply_mods(model)
    convert_to_loka(model, LoKAConfig(dispatch=False), log=lambda line: None)
    assert type(model[0]).__name__ == "FusedLinearMods"
    probe = ProbeCallback(interval=1, save_interval=100, out_dir=str(tmp_path / "probe"), tensorboard=False)
    state = TrainState(model=model)
    probe.on_train_start(state)
    assert set(probe.layers) == {"0", "3", "6"}  # the fused layers under their Linears' names, and the head
    probe.on_step_start(state)
    model(torch.randn(ROWS, 64)).sum().backward()
    probe.on_step_end(state)
    probe.on_train_end(state)
    layers = load_stats(tmp_path / "probe")["layers"]
    assert float(layers["3"]["activation"]["count"]) == ROWS and layers["3"]["has_bias"] is False


def test_config_paths_and_errors(tmp_path):
    cfg = OmegaConf.structured(ProbeConfig(enabled=True, interval=7, include=["a.*"]))
    probe = ProbeCallback.from_config(cfg, run_dir=tmp_path)
    assert probe.config.interval == 7 and probe.config.include == ["a.*"]
    assert probe.stats_path == tmp_path / "probe" / "stats.pt"
    assert ProbeCallback.from_config({"interval": 3}).config.interval == 3
    with pytest.raises(ValueError, match="valid fields"):
        ProbeCallback(intervall=3)
    with pytest.raises(ValueError, match="callbacks.probe.interval"):
        ProbeCallback(interval=0)
    with pytest.raises(ValueError, match="stats_dtype"):
        ProbeCallback(stats_dtype="float16")
    with pytest.raises(ValueError, match="callbacks.probe.momentum"):  # m = 0 keeps no deviation at all
        ProbeCallback(momentum=0.0)
    with pytest.raises(ValueError, match="callbacks.probe.interval: must be an integer, got float 2.5"):
        ProbeCallback(interval=2.5)
    with pytest.raises(ValueError, match="callbacks.probe.module_types: must be a list of strings or None, got str"):
        ProbeCallback(module_types="Linear")  # would be the class names 'L', 'i', ...: nothing observed


def test_a_step_before_on_train_start_is_refused_not_left_unobserved():
    probe = ProbeCallback(tensorboard=False, out_dir="unused")
    with pytest.raises(RuntimeError, match=r"call on_train_start\(state\) \(or attach\(model\)\) before"):
        probe.on_step_start(TrainState(model=Tower()))


def test_an_out_dir_that_cannot_be_written_fails_at_the_start_not_at_the_first_save(tmp_path):
    (tmp_path / "a_file").write_text("")
    probe = ProbeCallback(interval=1, save_interval=2, out_dir=str(tmp_path / "a_file" / "probe"), tensorboard=False)
    with pytest.raises(ValueError, match=r"ProbeCallback cannot write its statistics to .*a_file/probe' "
                                         r"\(.*a_file is not a directory\)"):
        probe.on_train_start(TrainState(model=nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))))
    ok = ProbeCallback(interval=1, out_dir=str(tmp_path / "new" / "probe"), tensorboard=False)
    ok.on_train_start(TrainState(model=nn.Sequential(nn.Linear(64, 128))))
    assert (tmp_path / "new" / "probe").is_dir()  # created at the start
    ok.close()


def test_save_does_not_block_the_step(tmp_path, monkeypatch):
    release, started = threading.Event(), threading.Event()

    def blocked_writer(obj, f):
        started.set()
        assert release.wait(20)
        torch.save(obj, f)

    monkeypatch.setattr(probe_mod, "AsyncSaver", lambda: AsyncSaver(writer=blocked_writer))
    probe = ProbeCallback(interval=1, save_interval=2, out_dir=str(tmp_path), tensorboard=False)
    model = Tower()
    state = TrainState(model=model)
    probe.on_train_start(state)
    for step in range(6):  # saves after steps 1, 3, 5 while the first write is still blocked
        state.step = step
        probe.on_step_start(state)
        model(torch.randn(ROWS, 8))
        probe.on_step_end(state)
    assert started.wait(5) and not (tmp_path / "stats.pt").exists()  # the loop ran on while disk was "slow"
    release.set()
    probe.close()
    assert load_stats(tmp_path)["step"] == 5


def test_tensorboard_scalars_per_layer(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    probe = ProbeCallback(interval=2, save_interval=100, run_dir=tmp_path)
    run_plain_loop(probe, steps=6)
    events = EventAccumulator(str(tmp_path / "tensorboard" / "probe"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"probe/head/act_max_abs", "probe/head/weight_norm", "probe/head/bias_norm"} <= tags
    assert "probe/inner.2/bias_norm" not in tags  # bias-free layer
    steps = [e.step for e in events.Scalars("probe/inner.0/act_std")]
    assert steps == [0, 2, 4]
    weight_norms = [e.value for e in events.Scalars("probe/head/weight_norm")]
    assert weight_norms[-1] != weight_norms[0]  # tracks training, not a constant


def _observe_loop(model: nn.Module, forward, probe: ProbeCallback, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = TrainState(model=model)
    probe.on_train_start(state)
    torch.manual_seed(1)
    for step in range(steps):
        state.step = step
        probe.on_step_start(state)
        loss = forward(torch.randn(8, 32)).square().mean()
        probe.on_after_forward(state)
        loss.backward()
        probe.on_after_backward(state)  # as the trainer fires it: re-arms, and the step's end disarms unused
        opt.step(); opt.zero_grad()
        probe.on_step_end(state)
    probe.close()


def test_observed_steps_of_a_compiled_model_run_compiled(tmp_path):
    """Compiled: one graph for observed steps and one for the others (the armed flag is a guard), no graph
    break, no recompilation after the first two, and the statistics of the eager run."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def model_and_probe():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        return model, ProbeCallback(interval=2, save_interval=1000, out_dir=tmp_path / "probe", tensorboard=False)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, probe = model_and_probe()
    _observe_loop(model, torch.compile(model, backend=counting_backend), probe, steps=8)
    eager_model, eager_probe = model_and_probe()
    _observe_loop(eager_model, eager_model, eager_probe, steps=8)
    assert len(graphs) == 2 and not torch._dynamo.utils.counters["graph_break"]
    for fqn, layer in probe.layers.items():
        eager = eager_probe.layers[fqn]
        assert int(layer.activation.moments.count) == int(eager.activation.moments.count) == 4 * 8  # 4 steps
        torch.testing.assert_close(layer.activation.moments.scatter, eager.activation.moments.scatter)
        torch.testing.assert_close(layer.weight.mean, eager.weight.mean)


def test_unobserved_steps_of_a_probed_token_mix_run_the_unprobed_graph(tmp_path):
    """The probe's hook on a token-axis Linear (Wukong's FM/LC blocks) must not switch the mix to its transposing
    route between observations: compiled, the probed model runs the same ops as the model without the probe."""
    def ops_of(probed: bool) -> list[list[str]]:
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append([str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")])
            return gm.forward

        torch.manual_seed(0)
        model = TokenMix(32, 48, bias=True)
        if probed:
            probe = ProbeCallback(interval=1000, out_dir=tmp_path / "probe", tensorboard=False)
            assert list(probe.attach(model)) == ["linear"]
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):
            compiled(torch.randn(4, 32, 16)).sum().backward()
        return graphs

    probed, plain = ops_of(True), ops_of(False)
    torch._dynamo.reset()
    assert probed == plain and len(plain) == 1


def test_wide_weight_factors_are_diagonal():
    """A wide layer's weight factors are diagonal (a full 4096-wide factor costs seconds of CPU per observation)."""
    probe = ProbeCallback(interval=1, out_dir="unused", tensorboard=False)
    probe.attach(nn.Sequential(nn.Linear(2048, 64), nn.ReLU(), nn.Linear(64, 1100)))
    wide_in, wide_out = probe.layers["0"].weight, probe.layers["2"].weight
    assert wide_in.diagonal_v and not wide_in.diagonal_u
    assert wide_out.diagonal_u and not wide_out.diagonal_v


class _ShardedParam:
    """Duck-types the two DTensor methods the probe uses: full_tensor() and to_local()."""

    def __init__(self, local: torch.Tensor, gathered: torch.Tensor):
        self.local, self.gathered = local, gathered

    def full_tensor(self) -> torch.Tensor:
        return self.gathered

    def to_local(self) -> torch.Tensor:
        return self.local


def test_a_gathered_weight_is_private_only_when_it_does_not_share_the_shards_storage():
    """The side stream reads a private gathered weight without a clone; one that is the local shard itself (a
    one-rank mesh) is cloned, since the optimizer writes it while the update may still be reading."""
    local = torch.randn(4, 3)
    module = nn.Module()
    module.weight = _ShardedParam(local, torch.cat([local, local]))
    assert full_parameter(module)[1] is True
    module.weight = _ShardedParam(local, local.view(4, 3))
    assert full_parameter(module)[1] is False
    plain = nn.Linear(3, 4)
    weight, private = full_parameter(plain)
    assert weight is plain.weight and private is False


def test_tensorboard_scalars_wait_for_their_copy_without_blocking_the_step():
    from loka_trainer.callbacks.probe import PendingScalars

    class InFlightCopy:  # stands in for the CUDA event of a device-to-host copy not finished yet
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    pending, written = PendingScalars(), []
    writer = type("Writer", (), {"add_scalar": lambda self, tag, value, step: written.append((tag, value, step))})()
    pending.submit(3, ["probe/a/act_mean"], torch.tensor([0.5]))  # on the CPU: no copy to wait for
    pending._queue.append((7, ["probe/a/act_mean", "probe/a/act_std"], torch.tensor([1.0, 2.0]), InFlightCopy()))
    pending.write(writer, wait=False)
    assert written == [("probe/a/act_mean", 0.5, 3)]  # the landed one only, the step goes on
    pending.write(writer, wait=True)
    assert written[1:] == [("probe/a/act_mean", 1.0, 7), ("probe/a/act_std", 2.0, 7)]


def test_state_bytes_announced_at_attach_are_what_the_trackers_hold_once_observed(tmp_path):
    probe = ProbeCallback(interval=5, out_dir=str(tmp_path / "probe"), tensorboard=False, max_full_weight_factor=16)
    probe.attach(Tower())
    announced = probe.state_bytes()
    run_plain_loop(probe, steps=6)
    held = 0
    for layer in probe.layers.values():
        tensors = [*layer.activation.moments.tensors(), layer.weight.mean, layer.weight.u, layer.weight.v]
        held += sum(t.numel() * t.element_size() for t in tensors)
    assert announced == held
    # inner.0 (32, 8): U diagonal (32 > 16), V full; float64: mean 32*8, U 32, V 8*8
    assert probe.layers["inner.0"].weight.state_bytes == (32 * 8 + 32 + 8 * 8) * 8
