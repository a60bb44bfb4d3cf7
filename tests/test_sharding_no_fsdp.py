"""``sharding.fsdp=false``: the dense part whole on the device, one rank only."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.config import check_single_rank_without_fsdp
from loka_trainer.data.config import DataConfig
from loka_trainer.data.schema import data_schema
from loka_trainer.models.configs import MODEL_CONFIGS
from loka_trainer.models.zoo import build_model
from loka_trainer.sharding.config import ShardingConfig, dense_part_line
from loka_trainer.sharding.parallelize import _dense_to_device


def test_no_fsdp_on_several_ranks_is_rejected_naming_the_reason():
    check_single_rank_without_fsdp(ShardingConfig(fsdp=False), world_size=1)
    check_single_rank_without_fsdp(ShardingConfig(fsdp=True), world_size=4)
    with pytest.raises(ValueError, match="sharding.fsdp=false needs one rank .world size 2.: nothing would average"):
        check_single_rank_without_fsdp(ShardingConfig(fsdp=False), world_size=2)


def test_without_fsdp_every_dense_parameter_and_buffer_moves_and_the_embeddings_stay():
    model = build_model(MODEL_CONFIGS["wukong"](), schema=data_schema(DataConfig()), loka_mods=False)
    embedding_params = {id(p) for n, p in model.named_parameters() if "embedding" in n}
    assert _dense_to_device(model, torch.device("meta")) == 0
    for unit in model.dense_units():
        assert all(t.device.type == "meta" for t in [*unit.parameters(), *unit.buffers()])
    assert embedding_params and all(p.device.type == "cpu" for p in model.parameters() if id(p) in embedding_params)


@pytest.mark.parametrize("config, line", [
    (ShardingConfig(fsdp=False), "dense part: 5 units whole on cuda:0 without FSDP2 (sharding.fsdp=false): parameters "
                                 "in their own dtype, gradients not reduced (one rank)"),
    (ShardingConfig(fsdp=False, fsdp_reduce_dtype="float32", fsdp_param_dtype="bfloat16"),
     "gradients not reduced (one rank); sharding.fsdp_param_dtype, sharding.fsdp_reduce_dtype unread"),
    (ShardingConfig(), "dense part: 6 FSDP2 units, reduce dtype bfloat16"),
    (ShardingConfig(fsdp_param_dtype="bfloat16"), "dense part: 6 FSDP2 units, reduce dtype bfloat16, parameter dtype "
                                                  "bfloat16"),
])
def test_the_dense_part_line_says_fsdp2s_dtypes_only_where_fsdp2_runs(config, line):
    """sharding.fsdp=false logged '0 FSDP2 units, reduce dtype float32': a dtype nothing reduced in."""
    logged = dense_part_line(config, num_fsdp_units=6 if config.fsdp else 0, num_dense_units=5, device="cuda:0")
    assert logged.endswith(line) and logged.startswith("dense part: "), logged
    assert ("FSDP2 units" in logged) == config.fsdp
