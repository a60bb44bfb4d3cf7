"""The public API importable from ``loka_trainer``: a user's own model through apply_mods and convert_to_loka."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import loka_trainer
from loka_trainer import DispatchPlan, LoKAConfig, apply_mods, convert_to_loka, register_weight_cache_hook
from loka_trainer.mods.layers import BlockNorm, HardSwish
from loka_trainer.mods.module import FusedLinearMods
from loka_trainer.mods.transform import find_unfusable


def _user_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.ReLU(),
                         nn.Linear(256, 256), nn.BatchNorm1d(256), nn.GELU(),
                         nn.Linear(256, 128), nn.ReLU(),  # no norm: not a Mods block
                         nn.Linear(128, 1))


def test_every_public_name_resolves_and_importing_the_package_stays_light():
    for name in loka_trainer.__all__:
        assert getattr(loka_trainer, name) is not None, name
    code = "import sys, loka_trainer; print(sorted(m for m in ('torch', 'triton', 'torchrec') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    with pytest.raises(AttributeError):
        loka_trainer.not_a_name  # noqa: B018


def test_apply_mods_turns_linear_norm_activation_blocks_into_the_mods():
    model = _user_model()
    weight = model[0].weight
    changed = apply_mods(model, block_size=128)
    assert changed == ["0", "3"]
    assert model[0].bias is None and model[3].bias is None and model[0].weight is weight
    assert isinstance(model[1], BlockNorm) and model[1].block_size == 128 and model[1].weight is None
    assert isinstance(model[4], BlockNorm) and isinstance(model[2], HardSwish) and isinstance(model[5], HardSwish)
    assert model[6].bias is not None and isinstance(model[7], nn.ReLU)  # Linear -> ReLU without a norm: unchanged
    assert model(torch.randn(8, 64)).shape == (8, 1)


def test_apply_mods_respects_the_filter_and_the_norms_width():
    model = _user_model()
    assert apply_mods(model, module_filter_fn=lambda mod, fqn: fqn != "0") == ["3"]
    assert model[0].bias is not None and isinstance(model[1], nn.LayerNorm)
    narrow = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(16), nn.ReLU())  # a norm over other features
    assert apply_mods(narrow) == []


def test_apply_mods_keeps_the_hooks_on_the_norm_and_activation_it_replaces():
    model = _user_model()
    seen = []
    handle = model[1].register_forward_hook(lambda mod, args, out: seen.append(type(mod).__name__))
    model[2].register_forward_pre_hook(lambda mod, args: seen.append(type(mod).__name__))
    apply_mods(model)
    model(torch.randn(4, 64))
    assert seen == ["BlockNorm", "HardSwish"]
    handle.remove()  # the user's handle still removes it from the new norm
    model(torch.randn(4, 64))
    assert seen == ["BlockNorm", "HardSwish", "HardSwish"]
    assert list(find_unfusable(model)) == ["0"]  # a hooked activation: the triple stays three modules


def test_convert_to_loka_fuses_the_mods_blocks_of_a_user_model_and_keeps_its_function():
    model = _user_model()
    apply_mods(model)
    x = torch.randn(32, 64)
    expected = model(x)
    plan = convert_to_loka(model, LoKAConfig(dispatch=False), device="cpu", log=lambda s: None)
    assert isinstance(plan, DispatchPlan) and plan.layers == {}
    fused = [fqn for fqn, m in model.named_modules() if isinstance(m, FusedLinearMods)]
    assert fused == ["0", "3"]
    torch.testing.assert_close(model(x), expected)


def test_convert_to_loka_with_dispatch_plans_each_target_and_writes_the_plan(tmp_path):
    model = _user_model()
    apply_mods(model)
    plan = convert_to_loka(model, LoKAConfig(timing_repeats=1, compute_dtype="float32"),
                           calibration_batch=torch.randn(64, 64), device="cpu", run_dir=tmp_path, log=lambda s: None)
    assert sorted(plan.layers) == ["0", "3", "6"]
    assert (tmp_path / "dispatch_plan.json").is_file()
    assert sum(isinstance(m, FusedLinearMods) for m in model.modules()) == 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    register_weight_cache_hook(model, opt).remove()


def test_a_plan_saved_with_save_loads_back_and_converts_a_fresh_model_without_measuring(tmp_path):
    """A DispatchPlan object had no public save or load: users wrote json.dump(plan.to_dict()) themselves."""
    model = _user_model()
    apply_mods(model)
    plan = convert_to_loka(model, LoKAConfig(timing_repeats=1, compute_dtype="float32"),
                           calibration_batch=torch.randn(64, 64), device="cpu", log=lambda s: None)
    path = plan.save(tmp_path / "mine" / "plan.json")
    assert path == tmp_path / "mine" / "plan.json"
    loaded = DispatchPlan.load(path)
    assert isinstance(loaded, DispatchPlan) and loaded.to_dict() == plan.to_dict()
    fresh = _user_model()
    apply_mods(fresh)
    reused = convert_to_loka(fresh, LoKAConfig(compute_dtype="float32", plan=str(path)), device="cpu",
                             log=lambda s: None)  # no calibration batch: nothing is measured
    assert {fqn: lp.backends() for fqn, lp in reused.layers.items()} == \
        {fqn: lp.backends() for fqn, lp in plan.layers.items()}


@pytest.mark.parametrize("content, reason", [
    (None, "file {path!r} does not exist"),
    ('{"version": 1, "device": "cpu", "layers": {"0": {"shape"', "is not valid JSON"),
    (b"\xff\xfe", "is not UTF-8 text, so not a plan file"),
    ('{"version": 2, "layers": {}}', "version must be 1, got 2"),
    ('{"version": 1, "layers": {"0": {"shape": {"M": 8, "K": 64}}}}', "layer '0': 'shape' needs integer M, K, N"),
])
def test_load_refuses_a_missing_or_damaged_plan_file_in_one_line(tmp_path, content, reason):
    path = tmp_path / "plan.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        DispatchPlan.load(path)
    message = str(err.value)
    assert message.startswith("DispatchPlan.load") and len(message.splitlines()) == 1, message
    assert reason.format(path=str(path)) in message and str(path) in message, message


def test_convert_to_loka_rejects_a_bad_config_in_one_line():
    with pytest.raises(ValueError, match=r"LoKAConfig\.mere_threshold: must be a finite number > 0"):
        convert_to_loka(_user_model(), LoKAConfig(mere_threshold=0.0), device="cpu")
