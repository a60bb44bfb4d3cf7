"""Checkpoint completeness, the resume decision and safe loading on a tiny model (no process group, seconds)."""
from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from loka_trainer import checkpoint as ckpt
from loka_trainer.resume import plan_start


def _save(root: Path, step: int, *, model=None) -> Path:
    model = model or nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return ckpt.save_checkpoint(root, step, model=model, dense_optimizer=opt, sparse_optimizer=None,
                                extra={"step": step}, local={"train_stream": {"position": step}, "callbacks": {}},
                                rank=0, world_size=1)


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under `path` -> (bytes, mtime_ns)."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def three_checkpoints(tmp_path: Path) -> tuple[Path, list[Path]]:
    """(the root, its checkpoints of steps 2, 4 and 6) under ``<tmp_path>/run/checkpoints``."""
    root = tmp_path / "run" / "checkpoints"
    return root, [_save(root, step) for step in (2, 4, 6)]


@pytest.fixture()
def three(tmp_path):
    return three_checkpoints(tmp_path)


def test_a_saved_checkpoint_is_complete_and_lists_its_files(three):
    root, paths = three
    record = ckpt.verify_checkpoint(paths[-1])
    assert record["step"] == 6 and record["world_size"] == 1
    assert {".metadata", "rank0.pt"} <= record["files"].keys()
    assert any(name.endswith(".distcp") for name in record["files"])
    assert (root / ckpt.LATEST).read_text() == "step_000006"


@pytest.mark.parametrize("fault, reason", [
    (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    (lambda p: os.truncate(p / "__0_0.distcp", 100), "__0_0.distcp has 100 bytes"),
    (lambda p: (p / "rank0.pt").unlink(), "rank0.pt is missing"),
    (lambda p: (p / "rank0.pt").write_bytes(b"garbage"), "rank0.pt has 7 bytes"),
    (lambda p: (p / "complete.json").unlink(), "no complete.json"),
    (lambda p: (p / "complete.json").write_text("{not json"), "complete.json is unreadable"),
])
def test_plan_start_skips_each_damaged_newest_checkpoint_with_its_reason(three, fault, reason):
    root, paths = three
    fault(paths[-1])
    plan = plan_start(root, resume=True, world_size=1)
    assert plan.checkpoint == paths[1] and plan.step == 4
    [warning] = plan.warnings()
    assert "step_000006" in warning and reason in warning and "world size" not in warning


def test_same_size_rewrite_of_a_rank_file_is_caught_by_its_digest(three):
    _, paths = three
    data = bytearray((paths[-1] / "rank0.pt").read_bytes())
    data[-40] ^= 0xFF
    (paths[-1] / "rank0.pt").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="SHA-256 mismatch"):
        ckpt.verify_checkpoint(paths[-1])


def test_no_complete_checkpoint_is_one_line_error_and_changes_nothing(three):
    root, paths = three
    for p in paths:
        (p / ".metadata").unlink()
    before = _tree(root)
    with pytest.raises(ckpt.CheckpointError) as info:
        plan_start(root, resume=True, world_size=1)
    assert "no complete checkpoint among the 3" in str(info.value) and "trainer.resume=false" in str(info.value)
    assert "\n" not in str(info.value)
    assert _tree(root) == before


def test_another_world_size_names_the_real_cause(three):
    root, _ = three
    with pytest.raises(ckpt.CheckpointError, match=r"written by 1 rank\(s\) and this run has 2"):
        plan_start(root, resume=True, world_size=2)


def test_no_checkpoints_and_resume_false_start_at_zero(tmp_path, three):
    assert plan_start(tmp_path / "empty", resume=True, world_size=1).checkpoint is None
    root, _ = three
    assert plan_start(root, resume=False, world_size=1).checkpoint is None


class _Payload:
    """Unpickling this runs ``os.mkdir(target)``: a stand-in for arbitrary code in a crafted file."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return os.mkdir, (self.target,)


def test_a_rank_file_holding_a_pickled_object_is_refused_not_executed(tmp_path):
    target = tmp_path / "payload_ran"
    file = tmp_path / "rank0.pt"
    with file.open("wb") as f:
        pickle.dump({"rng": _Payload(str(target))}, f)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_rank_state(file)
    assert "weights_only=True" in str(info.value) and "trusted source" in str(info.value)
    assert "\n" not in str(info.value)
    assert not target.exists()


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    np.random.normal()  # leaves a cached Gaussian in numpy's state
    torch.save({"rng": ckpt.rng_state()}, tmp_path / "rank0.pt")
    want = torch.rand(3), random.random(), np.random.normal(), np.random.rand()
    torch.manual_seed(9), random.seed(9), np.random.seed(9)
    ckpt.set_rng_state(ckpt.load_rank_state(tmp_path / "rank0.pt")["rng"])
    got = torch.rand(3), random.random(), np.random.normal(), np.random.rand()
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_load_restores_the_model_and_refuses_nothing_good(three):
    root, paths = three
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    saved = torch.load(paths[-1] / "rank0.pt", weights_only=True)
    extra, local = ckpt.load_checkpoint(paths[-1], model=model, dense_optimizer=opt, sparse_optimizer=None,
                                        extra_template={"step": 0}, rank=0)
    assert extra == {"step": 6} and local["train_stream"] == saved["train_stream"]
    assert opt.state_dict()["state"][0]["step"].item() == 1


@pytest.mark.parametrize("other, named", [
    (lambda: nn.Linear(4, 3), "of another shape, checkpoint vs model (2): bias [2] vs [3], weight [2, 4] vs [3, 4]"),
    (lambda: nn.Linear(4, 2, bias=False), "not in this model (1): bias"),
    (lambda: nn.Sequential(nn.Linear(4, 2)), "missing from the checkpoint (2): 0.bias, 0.weight"),
])
def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(three, other, named):
    _, paths = three
    model = other()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(paths[-1], model=model, dense_optimizer=torch.optim.Adam(model.parameters()),
                             sparse_optimizer=None, extra_template={"step": 0}, rank=0)
    message = str(info.value)
    assert "holds another model than this run builds" in message and named in message and "\n" not in message
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_model_difference_names_a_few_entries_and_counts_the_rest():
    wanted = {f"layer{i}.bias": (4,) for i in range(5)} | {"w": (2, 2), "step": None}
    found = {"w": (2, 3), "step": None, "extra": (1,)}
    text = ckpt.model_difference(wanted, found, shown=2)
    assert text == ("missing from the checkpoint (5): layer0.bias, layer1.bias and 3 more; not in this model (1): "
                    "extra; of another shape, checkpoint vs model (1): w [2, 3] vs [2, 2]")
    assert ckpt.model_difference(wanted, dict(wanted)) == ""


def test_a_checkpoint_of_another_optimizer_is_refused_in_one_line(three):
    """DCP reports a missing entry as a CheckpointException, a BaseException: it must still become one line."""
    _, paths = three
    model = nn.Linear(4, 2)
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(paths[-1], model=model, dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                     momentum=0.9),
                             sparse_optimizer=None, extra_template={"step": 0}, rank=0)
    message = str(info.value)
    assert "could not be loaded by torch.distributed.checkpoint (RuntimeError: Missing key" in message
    assert "dense_optimizer." in message and "trainer.dense_optimizer" in message
    assert "Traceback" not in message and "\n" not in message


def test_plan_start_refuses_a_checkpoint_written_for_another_model_and_accepts_one_without_identity(tmp_path):
    from loka_trainer.models.configs import WukongConfig
    from loka_trainer.resume import model_identity

    root = tmp_path / "checkpoints"
    _save(root, 2)  # no identity recorded (as before markers carried one): not compared
    assert plan_start(root, resume=True, world_size=1, identity={"anything": 1}).step == 2
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    saved = model_identity(WukongConfig(num_layers=2), loka_mods=False, dense_optimizer="adam")
    ckpt.save_checkpoint(root, 4, model=model, dense_optimizer=opt, sparse_optimizer=None, extra={"step": 4},
                         local={}, rank=0, world_size=1, model_identity=saved)
    assert ckpt.verify_checkpoint(root / "step_000004")["model"] == saved
    assert plan_start(root, resume=True, world_size=1, identity=saved).step == 4
    with pytest.raises(ckpt.CheckpointError) as info:
        plan_start(root, resume=True, world_size=1,
                   identity=model_identity(WukongConfig(num_layers=3), loka_mods=True, dense_optimizer="adam"))
    assert str(info.value).startswith(f"checkpoint {root / 'step_000004'} was written for another model "
                                      f"(model.num_layers=2 there, 3 here; precision.mods=false there, true here)")
    with pytest.raises(ckpt.CheckpointError, match='trainer.dense_optimizer="adam" there, "adamw" here'):
        plan_start(root, resume=True, world_size=1,  # Adam's state would load into AdamW without a word
                   identity=model_identity(WukongConfig(num_layers=2), loka_mods=False, dense_optimizer="adamw"))


def test_identity_difference_names_the_first_settings_and_counts_the_rest():
    from loka_trainer.resume import identity_difference

    saved = {"model": {"a": 1, "b": [1, 2], "mods": {"norm": None}}, "x": True}
    assert identity_difference(saved, saved) == ""
    now = {"model": {"a": 2, "b": [1, 3], "mods": {"norm": "layernorm"}, "c": 0}, "x": True}
    assert identity_difference(saved, now, shown=2) == ('model.a=1 there, 2 here; model.b=[1, 2] there, [1, 3] here; '
                                                       'and 1 more')
    # a setting the checkpoint does not record (written before it was recorded) is not compared; a dropped one is
    assert identity_difference(saved, {**saved, "y": 1}) == ""
    assert identity_difference(saved, {"model": saved["model"]}) == "x=true there, \"(unset)\" here"


def test_a_checkpoint_records_its_precision_and_a_resume_under_another_is_named_in_one_line(tmp_path):
    from loka_trainer.precision import PrecisionConfig, precision_identity
    from loka_trainer.resume import precision_change

    def identity(**fields):
        return precision_identity(PrecisionConfig(compute_dtype="bfloat16", **fields))

    tensorwise = identity(name="fp8_tensorwise", fp8_recipe="tensorwise", exclude=["mlp.*"])
    model = nn.Linear(4, 2)
    ckpt.save_checkpoint(tmp_path, 2, model=model, dense_optimizer=torch.optim.Adam(model.parameters()),
                         sparse_optimizer=None, extra={"step": 2}, local={}, rank=0, world_size=1,
                         precision=tensorwise)
    start = plan_start(tmp_path, resume=True, world_size=1)
    assert start.precision == tensorwise
    where = tmp_path / "step_000002"
    assert precision_change(start.precision, tensorwise, checkpoint=where) is None
    assert precision_change(None, identity(name="bf16"), checkpoint=where) is None  # recorded none: not compared
    line = precision_change(start.precision, identity(name="bf16"), checkpoint=where)
    assert line.startswith(f"resuming from {where} under another precision than it was trained with: "
                           f"precision=fp8_tensorwise (torchao float8 tensorwise) there, precision=bf16 (bfloat16 "
                           f"autocast) here; it holds no state of its precision"), line
    assert "\n" not in line and "fp8_filter" not in line  # a setting only one of the runs reads is not compared
    assert 'precision.fp8_filter="all" there, "auto" here' in precision_change(
        start.precision, identity(name="fp8_tensorwise", fp8_recipe="tensorwise", exclude=["mlp.*"],
                                  fp8_filter="auto"), checkpoint=where)
    loka = identity(name="loka", mods=True, dispatch=True)
    assert loka["dispatch"] and loka["runs_as"] == "LoKA Dispatch"
    assert "precision=loka (bfloat16 autocast with the Mods) there, precision=loka (LoKA Dispatch) here" in (
        precision_change(identity(name="loka", mods=True), loka, checkpoint=where))


def test_summary_steps_is_the_step_a_run_directorys_summary_records(tmp_path):
    """A run is finished at its newest checkpoint only when summary.json was written at that step: a shorter run's
    summary (the run continued with a higher trainer.steps, killed after its last checkpoint) is not its end."""
    from loka_trainer.resume import summary_steps

    assert summary_steps(tmp_path) is None
    (tmp_path / "summary.json").write_text(json.dumps({"model": "dlrm", "steps": 6}))
    assert summary_steps(tmp_path) == 6
    (tmp_path / "summary.json").write_text('{"steps": 6')  # cut short: no summary to trust
    assert summary_steps(tmp_path) is None


def test_nothing_left_when_the_checkpoint_ends_the_run():
    from loka_trainer.resume import StartPlan, nothing_left

    at = StartPlan(checkpoint=Path("ck/step_000020"), step=20)
    assert nothing_left(StartPlan(checkpoint=None, step=0), steps=20) is None
    assert nothing_left(at, steps=30) is None
    assert nothing_left(at, steps=20, finished=False) is None  # stopped before its summary: resume to finish
    assert nothing_left(at, steps=30, stop_after=20).startswith("nothing to do: the checkpoint ck/step_000020 is at "
                                                                  "step 20, trainer.stop_after=20")
    assert "trainer.steps=20" in nothing_left(at, steps=20)
    with pytest.raises(ckpt.CheckpointError, match="is at step 20, past trainer.steps=10"):
        nothing_left(at, steps=10)
    # a run of 30 steps stopped after its checkpoint at 20, started again with stop_after=10: it trained none and
    # wrote a summary of "10 steps" without a final evaluation, moving the step-20 evaluation out of metrics.jsonl
    for finished in (False, True):
        with pytest.raises(ckpt.CheckpointError, match="is at step 20, past trainer.stop_after=10: raise "
                                                       "trainer.stop_after"):
            nothing_left(at, steps=30, stop_after=10, finished=finished)
