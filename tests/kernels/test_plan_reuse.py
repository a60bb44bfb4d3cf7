"""A plan file is reproduced exactly (precision.plan=FILE), and a resumed run reuses its own plan."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from torch import nn

from loka_trainer.dispatch import convert as convert_mod
from loka_trainer.dispatch.convert import PLAN_FILE
from loka_trainer.dispatch.reuse import resumed_plan_file
from loka_trainer.kernels.linear import LoKALinear
from loka_trainer.mods.layers import BlockNorm, HardSwish
from loka_trainer.mods.module import FusedLinearMods
from loka_trainer.precision import PrecisionConfig, apply_precision

LOKA = dict(name="loka", compute_dtype="float32", mods=True, dispatch=True, timing_repeats=1)


class ModsModel(nn.Module):
    """x (B, 64) -> (B, 64): a fusable Linear -> BlockNorm -> HardSwish triple, then a plain Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 128, bias=False), BlockNorm(128, block_size=64),
                                 HardSwish(), nn.Linear(128, 64))

    def forward(self, x):
        return self.mlp(x)


# Hand-written (compact, key order of its own, no evidence fields): choices a measurement on CPU would not make.
HAND_PLAN = ('{"version": 1, "device": "by hand", "layers": {\n'
             ' "mlp.0": {"shape": {"M": 32, "K": 64, "N": 128}, "forward": {"backend": "scaled_mm_rowwise"},\n'
             '   "weight_grad": {"backend": "torchao_tensorwise"}, "mods_forward": {"mode": "split_fp8"},\n'
             '   "mods_input_grad": {"mode": "scaled_mm_tensorwise"}},\n'
             ' "mlp.3": {"shape": {"M": 32, "K": 128, "N": 64}, "input_grad": {"backend": "torchao_rowwise"},\n'
             '   "weight_grad": {"backend": "scaled_mm_tensorwise"}}}}\n')


def _convert(plan: Path, run_dir: Path) -> nn.Module:
    model = ModsModel()
    apply_precision(model, config=PrecisionConfig(**LOKA, plan=str(plan)), device="cpu", run_dir=run_dir,
                    log=lambda s: None)
    return model


def test_a_plan_file_is_run_exactly_and_copied_byte_for_byte(tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    monkeypatch.setattr(convert_mod, "build_plan", lambda *a, **k: pytest.fail("re-measured"))
    src = tmp_path / "hand.json"
    src.write_text(HAND_PLAN)
    model = _convert(src, tmp_path / "run")
    fused, last = model.mlp[0], model.mlp[3]
    assert isinstance(fused, FusedLinearMods)
    assert (fused.mode, fused.dgrad, fused.wgrad) == ("split_fp8", "scaled_mm_tensorwise", "torchao_tensorwise")
    assert isinstance(last, LoKALinear) and last.backends == {
        "forward": "bf16", "input_grad": "torchao_rowwise", "weight_grad": "scaled_mm_tensorwise"}
    assert (tmp_path / "run" / PLAN_FILE).read_bytes() == HAND_PLAN.encode()  # the run's record is the file


def test_the_run_directorys_own_plan_is_not_rewritten(tmp_path, monkeypatch):
    pytest.importorskip("torchao")
    monkeypatch.setattr(convert_mod, "build_plan", lambda *a, **k: pytest.fail("re-measured"))
    own = tmp_path / PLAN_FILE
    own.write_text(HAND_PLAN)
    os.utime(own, ns=(10**18, 10**18))
    _convert(own, tmp_path)
    assert own.read_bytes() == HAND_PLAN.encode() and own.stat().st_mtime_ns == 10**18


def test_resume_uses_the_runs_own_plan(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_000006"
    with pytest.raises(ValueError, match=f"needs the run's Dispatch plan {tmp_path / PLAN_FILE}, which is missing"):
        resumed_plan_file(tmp_path, None, checkpoint=ckpt)
    (tmp_path / PLAN_FILE).mkdir()
    with pytest.raises(ValueError, match=f"needs the run's Dispatch plan {tmp_path / PLAN_FILE}, which is not a file"):
        resumed_plan_file(tmp_path, None, checkpoint=ckpt)
    (tmp_path / PLAN_FILE).rmdir()
    (tmp_path / PLAN_FILE).write_text(HAND_PLAN)
    path, note = resumed_plan_file(tmp_path, None, checkpoint=ckpt)
    assert path == str(tmp_path / PLAN_FILE) and "not re-measured" in note
    same = tmp_path / "same.json"
    same.write_text(json.dumps(json.loads(HAND_PLAN), indent=4))  # other bytes, same plan
    assert resumed_plan_file(tmp_path, str(same), checkpoint=ckpt)[0] == str(tmp_path / PLAN_FILE)
    other = json.loads(HAND_PLAN)
    other["layers"]["mlp.3"]["input_grad"]["backend"] = "bf16"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="differs from the plan .* that the checkpoint .* was trained with"):
        resumed_plan_file(tmp_path, str(tmp_path / "other.json"), checkpoint=ckpt)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert resumed_plan_file(fresh, str(same), checkpoint=ckpt)[0] == str(same)  # no run plan: the named one


def test_a_resume_of_a_checkpoint_trained_without_dispatch_measures_a_plan_and_one_trained_with_it_does_not(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_000006"
    path, note = resumed_plan_file(tmp_path, None, checkpoint=ckpt, trained_with_dispatch=False)
    assert path is None and note == (f"resuming from {ckpt}, trained without Dispatch: Dispatch measures this run's "
                                     f"plan now and writes it to {tmp_path / PLAN_FILE}, which later resumes reuse")
    for recorded in (True, None):  # trained with Dispatch, or a checkpoint that does not say: its plan is missing
        with pytest.raises(ValueError, match="needs the run's Dispatch plan"):
            resumed_plan_file(tmp_path, None, checkpoint=ckpt, trained_with_dispatch=recorded)
    (tmp_path / PLAN_FILE).write_text(HAND_PLAN)  # an earlier Dispatch phase's plan: reused, not re-measured
    assert resumed_plan_file(tmp_path, None, checkpoint=ckpt, trained_with_dispatch=False)[0] == str(
        tmp_path / PLAN_FILE)
