"""Every parameter trains: no embedding table is left data-parallel, whose weight TorchRec leaves to the dense
optimizer (ours holds only the dense units)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan, ShardingType

from loka_trainer.sharding.config import ShardingConfig
from loka_trainer.sharding.parallelize import without_data_parallel
from tests.spawn import run_on_ranks
from tests.test_nonfinite import _local_state

WORLD = 2
RUN = ["data.batch_size=64", "data.eval_batches=0", "trainer.steps=3", "trainer.checkpoint_interval=0",
       "callbacks.progress=false", "callbacks.tensorboard=false"]
# With 20-row tables TorchRec's planner would replicate every DLRM table on 2 CPU ranks (data-parallel); at its
# CPU size it would replicate InterFormer's 7 tables of at most 27 rows.
CASES = {"dlrm_20_row_tables": ["model=dlrm", "data.max_vocab_size=20"], "dlrm_dcnv2": ["model=dlrm_dcnv2"],
         "wukong": ["model=wukong"], "interformer": ["model=interformer"]}


def _plan(types: dict[str, str]) -> ShardingPlan:
    module_plan = EmbeddingModuleShardingPlan(
        {name: ParameterSharding(sharding_type=t, compute_kernel="dense" if t == "data_parallel" else "fused",
                                 ranks=[0]) for name, t in types.items()})
    return ShardingPlan({"sparse_arch.ebc": module_plan})


def test_a_plan_without_data_parallel_tables_is_kept():
    assert without_data_parallel(_plan({"a": "table_wise", "b": "row_wise"})) is None


def test_data_parallel_tables_become_table_wise_and_the_others_keep_their_choice():
    pinned = without_data_parallel(_plan({"a": "data_parallel", "b": "row_wise", "c": "column_wise"}))
    assert pinned["a"].sharding_types == [ShardingType.TABLE_WISE.value]
    assert (pinned["b"].sharding_types, pinned["b"].compute_kernels) == (["row_wise"], ["fused"])
    assert (pinned["c"].sharding_types, pinned["c"].compute_kernels) == (["column_wise"], ["fused"])


def test_data_parallel_is_not_a_sharding_choice():
    with pytest.raises(ValueError, match="sharding.embedding='data_parallel' is not one of"):
        ShardingConfig(embedding="data_parallel").validate()


def _worker(rank: int, out_dir: str, overrides: list[str]) -> None:
    from loka_trainer.callbacks.base import Callback
    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas, to_run_config
    from loka_trainer.sharding.dist import DistInfo
    from loka_trainer.trainer import Trainer

    register_schemas()
    cfg = compose_config("config", [*overrides, *RUN]).cfg
    snapshots: list[dict[str, torch.Tensor]] = []

    class Snapshot(Callback):
        def on_train_start(self, state):
            snapshots.append(_local_state(state.model))

        def on_train_end(self, state):
            snapshots.append(_local_state(state.model))

    dist_info = DistInfo(rank=rank, world_size=WORLD, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    lines: list[str] = []
    trainer = Trainer(to_run_config(cfg), run_dir=Path(out_dir), dist_info=dist_info, extra_callbacks=[Snapshot()],
                      log=lines.append)
    trainer.fit(0)
    before, after = snapshots
    moved = {k: not torch.equal(before[k], after[k]) for k in before if before[k].is_floating_point()}
    torch.save({"plan": trainer.parallel.sharding_plan, "moved": moved, "log": lines}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_parameter_of_every_zoo_model_trains_on_two_ranks(tmp_path, case):
    run_on_ranks(_worker, WORLD, str(tmp_path), CASES[case])
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    held = {k for r in results for k in r["moved"]}
    assert sum("embedding" in k for k in held) >= 26, sorted(held)
    not_trained = sorted(k for k in held if not any(r["moved"].get(k) for r in results))
    assert not not_trained, not_trained
    assert "data_parallel" not in results[0]["plan"]
    replanned = [line for line in results[0]["log"] if line.startswith("TorchRec's planner replicated")]
    expected = {"dlrm_20_row_tables": "26 table(s)", "interformer": "7 table(s)"}.get(case)
    assert [expected in line for line in replanned] == ([True] if expected else [])
