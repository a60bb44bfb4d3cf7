"""trainer.nonfinite: `error` stops naming the step and saves nothing of that state; `skip_step` skips the whole
step (no backward: neither the dense nor TorchRec's fused embedding optimizer moves) on every rank."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from loka_trainer.nonfinite import NonFiniteGuard
from tests.launch import SMALL, run_train
from tests.spawn import run_on_ranks

WORLD = 2
POISONED_STEP = 3  # 1-based, as in metrics.jsonl


def test_bad_policy_fails_with_one_line_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(["trainer.nonfinite=ignore", f"hydra.run.dir={run_dir}"], check=False, timeout=60)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "trainer.nonfinite='ignore' is not one of error, skip_step" in line
    assert not run_dir.exists()


def test_error_policy_records_the_first_bad_step_without_skipping():
    guard = NonFiniteGuard("error", device=torch.device("cpu"))
    assert not guard.skip(torch.tensor(0.5), step=1)
    assert guard.first_bad() is None
    assert not guard.skip(torch.tensor(float("nan")), step=2)
    guard.record_gradients([torch.tensor([1.0, float("inf")]), torch.empty(0), None], step=2)
    assert not guard.skip(torch.tensor(float("inf")), step=3)
    assert guard.first_bad() == ("loss", 2)
    assert guard.skipped_steps == 0


def test_skip_policy_skips_only_non_finite_losses_and_counts_them():
    guard = NonFiniteGuard("skip_step", device=torch.device("cpu"))
    assert [guard.skip(torch.tensor(v), step=i) for i, v in enumerate([0.5, float("nan"), 0.4, float("-inf")])] \
        == [False, True, False, True]
    assert guard.skipped_steps == 2 and guard.first_bad() is None
    guard.record_gradients([torch.tensor([3e38, 3e38])], step=5)  # huge but finite: not flagged
    assert guard.first_bad() is None
    guard.record_gradients([torch.tensor([float("nan")])], step=6)
    assert guard.first_bad() == ("gradient", 6)


@pytest.mark.slow
def test_lr_1e6_stops_at_the_first_nan_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path):
    """Default data sizes: trainer.lr=1e6 turns the loss NaN at step 2."""
    run_dir = tmp_path / "run"
    proc = run_train(["model=dlrm", "trainer.lr=1e6", "trainer.steps=6", "trainer.log_interval=1",
                      "trainer.eval_interval=0", "trainer.checkpoint_interval=1", "data.eval_batches=2",
                      "callbacks.progress=false", "callbacks.tensorboard=false", f"hydra.run.dir={run_dir}"],
                     check=False)
    assert proc.returncode == 3, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: non-finite loss at step 2 (trainer.nonfinite=error)")
    assert "step_000001" in line and "Traceback" not in proc.stderr
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000001"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000001"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["loss"] is not None
    assert not (run_dir / "summary.json").exists()


def _local_state(model) -> dict[str, torch.Tensor]:
    """This rank's shards of every model tensor (FSDP2 DTensors and TorchRec ShardedTensors included)."""
    out = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "to_local"):
            value = value.to_local()
        elif hasattr(value, "local_shards"):
            shards = value.local_shards()
            if not shards:
                continue
            value = torch.cat([s.tensor.flatten() for s in shards])
        out[key] = value.detach().clone()
    return out


def _poisoned(batches, *, rank: int):
    """The training stream with NaN dense features on rank 0 only at POISONED_STEP (rank 1's loss stays finite)."""
    for index, batch in enumerate(batches):
        if rank == 0 and index + 1 == POISONED_STEP:
            batch = dataclasses.replace(batch, dense=torch.full_like(batch.dense, float("nan")))
        yield batch


def _worker(rank: int, out_dir: str, policy: str) -> None:
    from loka_trainer.callbacks.base import Callback
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.nonfinite import NonFiniteError
    from loka_trainer.sharding.dist import DistInfo
    from loka_trainer.trainer import Trainer

    register_schemas()
    cfg, _, _ = compose_config("config", ["model=dlrm", *SMALL, "trainer.steps=5", "trainer.log_interval=1",
                                       "trainer.eval_interval=0", "trainer.checkpoint_interval=2",
                                       "callbacks.tensorboard=false", f"trainer.nonfinite={policy}"])
    run = to_run_config(cfg)
    snapshots: list[dict[str, torch.Tensor]] = []

    class Snapshot(Callback):
        def on_step_end(self, state):
            snapshots.append(_local_state(state.model))

    dist_info = DistInfo(rank=rank, world_size=WORLD, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    trainer = Trainer(run, run_dir=Path(out_dir), dist_info=dist_info, extra_callbacks=[Snapshot()])
    trainer.train_iter = _poisoned(trainer.train_iter, rank=rank)
    try:
        trainer.fit(0)
        outcome = "finished"
    except NonFiniteError as exc:
        outcome = str(exc)
    torch.save({"outcome": outcome, "snapshots": snapshots, "skipped": trainer.nonfinite.skipped_steps},
               Path(out_dir) / f"result{rank}.pt")


def _results(out_dir: Path) -> list[dict]:
    return [torch.load(out_dir / f"result{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.slow
def test_skip_step_on_two_ranks_skips_dense_and_embedding_updates_when_one_rank_sees_nan(tmp_path):
    run_on_ranks(_worker, WORLD, str(tmp_path), "skip_step")
    for rank, result in enumerate(_results(tmp_path)):
        assert result["outcome"] == "finished" and result["skipped"] == 1, rank
        before, skipped, after = (result["snapshots"][i] for i in (POISONED_STEP - 2, POISONED_STEP - 1,
                                                                     POISONED_STEP))
        embeddings = [k for k in before if "embedding" in k]
        assert embeddings, sorted(before)
        for key in before:  # the skipped step changed nothing, dense or embedding, on either rank
            assert torch.equal(skipped[key], before[key]), (rank, key)
        assert any(not torch.equal(after[k], skipped[k]) for k in embeddings)  # training went on
        assert all(torch.isfinite(t).all() for t in after.values())
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if "eval_auc" not in r}
    assert by_step[POISONED_STEP] == {"step": POISONED_STEP, "skipped_steps": 1}
    assert by_step[POISONED_STEP + 1]["skipped_steps"] == 1 and by_step[POISONED_STEP + 1]["loss"] is not None
    assert by_step[POISONED_STEP - 1]["skipped_steps"] == 0
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 1


@pytest.mark.slow
def test_error_on_two_ranks_stops_both_naming_the_step_and_saves_nothing_after_it(tmp_path):
    run_on_ranks(_worker, WORLD, str(tmp_path), "error")
    for result in _results(tmp_path):
        assert result["outcome"].startswith(f"non-finite loss at step {POISONED_STEP} (trainer.nonfinite=error)")
        assert len(result["snapshots"]) == POISONED_STEP - 1  # stopped before reporting the poisoned step
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002"]
