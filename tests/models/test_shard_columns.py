"""``sharding.config.shard_columns``: the column counts of a table's shards, cut as TorchRec's planner cuts them
(``check_embedding_columns`` refuses an ``embedding_dim`` that gives one FBGEMM's kernels cannot take)."""
from __future__ import annotations

import pytest
from torchrec.distributed.sharding_plan import _calculate_cw_shard_sizes_and_offsets

from loka_trainer.sharding.config import check_embedding_columns, shard_columns


@pytest.mark.filterwarnings("ignore:Dim of")
def test_column_shards_are_cut_as_torchrec_cuts_them():
    for dim in range(1, 600):
        sizes, _ = _calculate_cw_shard_sizes_and_offsets(dim, rows=10)
        assert shard_columns(dim, "column_wise") == [cols for _, cols in sizes], dim
        assert shard_columns(dim, "table_wise") == shard_columns(dim, "row_wise") == [dim]


def test_only_multiples_of_four_give_every_shard_a_width_the_kernels_take():
    for dim in range(1, 600):
        if dim % 4:
            with pytest.raises(ValueError, match=f"model.embedding_dim={dim} must be a multiple of 4"):
                check_embedding_columns(dim)
        else:
            check_embedding_columns(dim)
