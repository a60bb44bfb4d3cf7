"""A converted model as a user's own trainer keeps using it: what convert_to_loka must leave intact of the model
it was given (parametrized weights, hooks) and what the FP8 layers must see after it (weight edits)."""
from __future__ import annotations

import json
from typing import Optional

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from loka_trainer import LoKAConfig, convert_to_loka, register_weight_cache_hook
from loka_trainer.kernels.linear import LoKALinear, weight_caches
from loka_trainer.mods.layers import BlockNorm, HardSwish
from loka_trainer.mods.module import FusedLinearMods
from loka_trainer.probe.targets import select_linears

# every GEMM FP8 on the CPU: any speedup and any error pass
FP8 = dict(compute_dtype="float32", timing_repeats=1, timing_rounds=1, min_features=16, min_speedup=1e-6,
           mere_threshold=10.0, backends=["scaled_mm_tensorwise"])


def _mlp() -> nn.Sequential:
    """x (B, 64) -> (B, 1): a Mods triple (fusable at block 64), a plain Linear and the head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=False), BlockNorm(128, block_size=64), HardSwish(),
                         nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))


def _convert(model: nn.Module, logs: list[str], run_dir=None, **overrides) -> None:
    convert_to_loka(model, LoKAConfig(**{**FP8, **overrides}), calibration_batch=torch.randn(64, 64),
                    device="cpu", run_dir=run_dir, log=logs.append)


def test_a_parametrized_linear_stays_bf16_and_keeps_training_and_its_state_dict():
    model, logs = _mlp(), []
    for i in (0, 3):
        parametrizations.weight_norm(model[i])
    keys = list(model.state_dict())
    _convert(model, logs)
    assert not any(isinstance(m, (LoKALinear, FusedLinearMods)) for m in model.modules())
    assert list(model.state_dict()) == keys  # weight_norm's g and v, not a frozen computed weight
    assert any("2 parametrized Linear(s) stay BF16" in line and line.endswith(": 0, 3") for line in logs), logs
    assert any("0 (its weight is parametrized)" in line for line in logs), logs
    x = torch.randn(32, 64)
    before = model(x).detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(model(x), before)


def test_hooks_registered_before_convert_keep_running_and_their_handles_remove_them():
    model, logs, seen = _mlp(), [], []
    pre = model[0].register_forward_pre_hook(lambda m, args: seen.append(("pre 0", type(m).__name__)))
    model[3].register_forward_hook(lambda m, args, out: seen.append(("post 3", type(m).__name__)))
    model[3].register_forward_pre_hook(lambda m, args: seen.append(("pre 3", type(m).__name__)))
    _convert(model, logs)
    assert type(model[0]) is FusedLinearMods and type(model[3]) is LoKALinear
    seen.clear()  # the calibration forward ran them too
    model(torch.randn(16, 64))
    assert seen == [("pre 0", "FusedLinearMods"), ("pre 3", "LoKALinear"), ("post 3", "LoKALinear")]
    pre.remove()
    seen.clear()
    model(torch.randn(16, 64))
    assert [name for name, _ in seen] == ["pre 3", "post 3"]


def test_a_mods_triple_with_a_hook_only_its_own_modules_can_run_stays_unfused_and_named():
    model, logs, seen = _mlp(), [], []
    model[1].register_forward_hook(lambda m, args, out: seen.append(out.shape))  # the BlockNorm's output
    _convert(model, logs, dispatch=False, backends=None)
    assert type(model[1]) is BlockNorm and not any(isinstance(m, FusedLinearMods) for m in model)
    assert any("1 stay unfused" in line and "0 (a hook on its BlockNorm)" in line for line in logs), logs
    model(torch.randn(16, 64))
    assert seen == [(16, 128)]


def test_timing_the_fused_mods_layers_leaves_the_users_random_stream_alone():
    """Dispatch times each fused layer (on a GPU, inside convert_to_loka) at random operands: drawn from the global
    generator, they would move the user's stream, and a run measuring its plan would draw other dropout masks
    than the same run loading that plan."""
    from loka_trainer.dispatch import mods_timing
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    shape, common = (32, 64, 256), dict(wgrad="bf16", block=256, eps=1e-6, timer=lambda fn: (fn(), 1.0)[1],
                                        device="cpu", rounds=1)
    mods_timing.time_modes(*shape, ["split_bf16"], **common)
    mods_timing.time_input_grads(*shape, ["bf16"], mode="split_bf16", **common)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_loaded_plan_that_does_not_name_every_target_says_which_stay_bf16(tmp_path):
    small, logs = _mlp(), []
    _convert(small, logs, mods=False, run_dir=tmp_path / "small")
    wider = nn.Sequential(*_mlp(), nn.Linear(1, 32), nn.Linear(32, 32))  # the same layers and one target more
    _convert(wider, logs, mods=False, plan=str(tmp_path / "small" / "dispatch_plan.json"))
    assert type(wider[0]) is LoKALinear and type(wider[7]) is nn.Linear
    assert "1 target Linear(s) the plan does not name stay BF16: 7" in logs


def test_weight_writes_between_steps_reach_the_fp8_casts_as_the_readme_says():
    """In place (``load_state_dict``, ``p.copy_`` under no_grad): re-cast at the next forward. Through ``p.data``
    (autograd's version counter does not count it): seen at the next optimizer step."""
    from loka_trainer import register_weight_cache_hook
    model, logs = _mlp(), []
    _convert(model, logs)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a step that changes no weight, only clears the casts
    register_weight_cache_hook(model, opt)
    x, weight = torch.randn(16, 64), model[3].weight

    def after_write(write) -> tuple[torch.Tensor, torch.Tensor]:
        """(output right after ``write``, output once the optimizer stepped)."""
        model(x)  # casts the weight as it is
        with torch.no_grad():
            write()
        out = model(x)
        opt.step()
        return out, model(x)

    now, after_step = after_write(lambda: weight.copy_(torch.randn_like(weight)))
    assert torch.equal(now, after_step)
    now, after_step = after_write(lambda: weight.data.copy_(torch.randn_like(weight)))
    assert not torch.equal(now, after_step)


class DataSGD(torch.optim.Optimizer):
    """SGD written as many hand-made optimizers still are: through ``p.data``, which bumps no version counter."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def _served_vs_weights(model: nn.Module, x: torch.Tensor) -> float:
    """Largest gap between ``model(x)`` and the same converted model, uncached, holding its current weights."""
    fresh, logs = _mlp(), []
    _convert(fresh, logs)
    fresh.load_state_dict(model.state_dict())
    return (model(x) - fresh(x)).abs().max().item()


def test_without_the_cache_hook_an_optimizer_writing_p_data_trains_the_weights_the_forward_uses():
    """Its steps bump no version counter: a cache reused across them would serve the first step's FP8 weights to
    every later forward (the loss hardly moves then)."""
    model, logs = _mlp(), []
    _convert(model, logs)
    opt, x = DataSGD(model.parameters(), lr=0.5), torch.randn(64, 64)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert _served_vs_weights(model, x) == 0.0


def test_a_copy_of_a_hooked_model_is_not_served_by_the_originals_hook():
    """An EMA or evaluation copy (deepcopy) has no optimizer clearing its casts: it casts afresh at each call."""
    import copy

    from loka_trainer import register_weight_cache_hook
    model, logs = _mlp(), []
    _convert(model, logs)
    register_weight_cache_hook(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema, x = copy.deepcopy(model), torch.randn(64, 64)
    ema(x)
    for p in ema.parameters():
        p.data.mul_(0.5)
    assert _served_vs_weights(ema, x) == 0.0


def test_functional_call_with_temporary_weights_is_served_each_calls_own_weights():
    """``torch.func.functional_call`` with parameters made for the call: each temporary is freed after it and the
    next one, of the same size, takes its address at version 0, the key the hooked cache served the old cast by."""
    from torch.func import functional_call

    from loka_trainer import register_weight_cache_hook
    model, logs = _mlp(), []
    _convert(model, logs)
    register_weight_cache_hook(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, params = torch.randn(16, 64), dict(model.named_parameters())
    for scale in (0.5, 2.0, -1.0):
        scaled = {name: p.detach() * scale for name, p in params.items()}
        with torch.no_grad():
            out = functional_call(model, scaled, (x,))
            fresh, logs = _mlp(), []
            _convert(fresh, logs)
            fresh.load_state_dict(scaled)
            assert torch.equal(out, fresh(x))
        del scaled


def test_a_compiled_model_is_converted_inside_its_wrapper_under_the_names_the_probe_gives_its_layers(tmp_path):
    """``torch.compile(model)`` first, then convert_to_loka: converting the wrapper itself would name every layer
    ``_orig_mod.N`` in the plan, which then loads into no uncompiled model and fits no Probe report (whose names
    drop the wrapper)."""
    model, logs = _mlp(), []
    compiled = torch.compile(model)
    _convert(compiled, logs, run_dir=tmp_path / "compiled")
    assert type(model[0]) is FusedLinearMods and type(model[3]) is LoKALinear and compiled._orig_mod is model
    plan = json.loads((tmp_path / "compiled" / "dispatch_plan.json").read_text())
    assert sorted(plan["layers"]) == ["0", "3"] and set(plan["layers"]) <= set(select_linears(compiled))
    _convert(_mlp(), logs, plan=str(tmp_path / "compiled" / "dispatch_plan.json"))  # the same model, uncompiled


class _Holder(nn.Module):
    """x (B, 64) -> (B, 1): ``_mlp()`` as the submodule ``dense``, compiled there (dynamo's eager backend: the
    wrapper without inductor's compile time) or not."""

    def __init__(self, compiled: bool, dense: Optional[nn.Module] = None) -> None:
        super().__init__()
        dense = _mlp() if dense is None else dense
        self.dense = torch.compile(dense, backend="eager") if compiled else dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


def test_a_compiled_submodule_is_converted_inside_its_wrapper_and_its_layers_keep_the_models_own_names(tmp_path):
    """``model.dense = torch.compile(model.dense)``, then convert_to_loka: the plan names its layers ``dense.0``,
    not ``dense._orig_mod.0``, as the uncompiled model's plan and the Probe do, and either plan applies to the other
    model."""
    plain, compiled, logs = _Holder(compiled=False), _Holder(compiled=True), []
    _convert(plain, logs, run_dir=tmp_path / "plain")
    _convert(compiled, logs, run_dir=tmp_path / "compiled")
    inner = compiled.dense._orig_mod
    assert type(inner[0]) is FusedLinearMods and type(inner[3]) is LoKALinear
    x = torch.randn(16, 64)
    assert torch.equal(compiled(x), plain(x))
    layers = {run: json.loads((tmp_path / run / "dispatch_plan.json").read_text())["layers"]
              for run in ("plain", "compiled")}
    assert sorted(layers["compiled"]) == sorted(layers["plain"]) == ["dense.0", "dense.3"]
    assert sorted(select_linears(_Holder(compiled=True))) == ["dense.0", "dense.3", "dense.5"]
    for model, run in ((_Holder(compiled=True), "plain"), (_Holder(compiled=False), "compiled")):
        plan = convert_to_loka(model, LoKAConfig(**{**FP8, "plan": str(tmp_path / run / "dispatch_plan.json")}),
                               device="cpu", log=logs.append)
        assert sorted(plan.layers) == ["dense.0", "dense.3"] and type(model.get_submodule("dense.3")) is LoKALinear


def test_exclude_and_loka_keep_bf16_name_the_layers_of_a_compiled_submodule_by_the_models_own_names():
    model, logs = _Holder(compiled=True), []
    plan = convert_to_loka(model, LoKAConfig(**{**FP8, "exclude": ["dense.3"]}), calibration_batch=torch.randn(64, 64),
                           device="cpu", log=logs.append)
    assert sorted(plan.layers) == ["dense.0"] and type(model.dense._orig_mod[3]) is nn.Linear
    declaring = _mlp()
    declaring.loka_keep_bf16 = ("3",)
    model = _Holder(compiled=True, dense=declaring)
    plan = convert_to_loka(model, LoKAConfig(**FP8), calibration_batch=torch.randn(64, 64), device="cpu",
                           log=logs.append)
    assert sorted(plan.layers) == ["dense.0"] and type(declaring[3]) is nn.Linear


def test_a_linear_compiled_on_its_own_stays_bf16_and_named():
    """``dense[3] = torch.compile(dense[3])``: the compiled forward runs the Linear it was compiled with, so a
    LoKALinear swapped in under the wrapper would never run."""
    model, logs = _Holder(compiled=False), []
    linear = model.dense[3]
    model.dense[3] = torch.compile(linear, backend="eager")
    _convert(model, logs)
    assert model.dense[3]._orig_mod is linear and type(linear) is nn.Linear
    assert any(line.startswith("1 Linear(s) compiled on their own stay BF16") and line.endswith(": dense.3")
               for line in logs), logs


def test_the_weight_cache_hook_before_convert_warns_and_after_it_ties_every_loka_layer():
    model, logs = _mlp(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="no LoKA layer"):
        register_weight_cache_hook(model, opt)
    _convert(model, logs)
    caches = weight_caches(model)
    assert caches and all(c.hooks == 0 for c in caches)  # the early hook found nothing to tie
    register_weight_cache_hook(model, opt)
    assert all(c.hooks == 1 for c in caches)


def test_a_loaded_plan_names_the_measurement_settings_it_leaves_unread(tmp_path):
    logs = []
    _convert(_mlp(), logs, mods=False, run_dir=tmp_path)
    plan = str(tmp_path / "dispatch_plan.json")
    convert_to_loka(_mlp(), LoKAConfig(plan=plan, mods=False, min_features=16), device="cpu", log=logs.append)
    assert not any("not read" in line for line in logs)  # defaults: nothing the user set goes unread
    _convert(_mlp(), logs, mods=False, plan=plan)
    assert (f"the plan {plan} runs as it was measured; these settings are not read: mere_threshold, min_speedup, "
            f"timing_repeats, timing_rounds") in logs
