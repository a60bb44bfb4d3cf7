"""``sharding.fsdp=false``: the dense part whole on the device, one rank only."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.config import check_single_rank_without_fsdp
from loka_trainer.data.config import DataConfig
from loka_trainer.data.schema import data_schema
from loka_trainer.models.configs import MODEL_CONFIGS
from loka_trainer.models.zoo import build_model
from loka_trainer.sharding.config import ShardingConfig
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
