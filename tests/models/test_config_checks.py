"""Model configs' own checks (``validate``, run by train.py's preflight): sizes and the embedding width, one line
naming the field, before any process group starts."""
from __future__ import annotations

import dataclasses
import re

import pytest

from loka_trainer.models.configs import MODEL_CONFIGS, DLRMConfig, InterFormerConfig, WukongConfig
from loka_trainer.models.configs import DLRMDCNv2Config as DCNv2

ZERO_ALLOWED = ("cross_layers",)  # sizes that may be 0: a DCNv2 or InterFormer without cross layers


def _rejected(cfg, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        cfg.validate()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("cfg, message", [
    (DLRMConfig(embedding_dim=0, dense_arch_widths=[64, 0]), "model.embedding_dim must be >= 1, got 0"),
    (DLRMConfig(embedding_dim=-4, dense_arch_widths=[64, -4]), "model.embedding_dim must be >= 1, got -4"),
    (DLRMConfig(over_arch_widths=[0]), "model.over_arch_widths must list widths >= 1, got [0]"),
    (DCNv2(cross_rank=0), "model.cross_rank must be >= 1, got 0"),
    (DCNv2(cross_layers=-1), "model.cross_layers must be >= 0, got -1"),
    (WukongConfig(fm_rank=0), "model.fm_rank must be >= 1, got 0"),
    (WukongConfig(num_fm_embeddings=0), "model.num_fm_embeddings must be >= 1, got 0"),
    (WukongConfig(num_dense_embeddings=0), "model.num_dense_embeddings must be >= 1, got 0"),
    (WukongConfig(num_lc_embeddings=0), "model.num_lc_embeddings must be >= 1, got 0"),
    (WukongConfig(fmb_widths=[512, 0]), "model.fmb_widths must list widths >= 1, got [512, 0]"),
    (InterFormerConfig(num_heads=0), "model.num_heads must be >= 1, got 0"),
    (InterFormerConfig(num_sequences=0), "model.num_sequences must be >= 1, got 0"),
    (InterFormerConfig(num_pma_seeds=0), "model.num_pma_seeds must be >= 1, got 0"),
])
def test_sizes_below_their_least_value_are_one_line_naming_the_field(cfg, message):
    _rejected(cfg, message)


@pytest.mark.parametrize("name", sorted(MODEL_CONFIGS))
def test_every_size_field_of_every_model_is_checked(name):
    cls = MODEL_CONFIGS[name]
    cls().validate()
    for field in dataclasses.fields(cls):
        default = getattr(cls(), field.name)
        if isinstance(default, bool) or not isinstance(default, (int, list)):
            continue
        if isinstance(default, int):
            least = 0 if field.name in ZERO_ALLOWED else 1
            _rejected(dataclasses.replace(cls(), **{field.name: least - 1}), f"model.{field.name} must be >= {least}")
        else:
            _rejected(dataclasses.replace(cls(), **{field.name: [0]}), f"model.{field.name} must list widths >= 1")


def test_no_cross_layers_is_valid():
    DCNv2(cross_layers=0).validate()
    InterFormerConfig(cross_layers=0).validate()


@pytest.mark.parametrize("dim", [3, 6, 130, 254])
def test_an_embedding_dim_no_table_shard_can_take_is_one_line(dim):
    _rejected(WukongConfig(embedding_dim=dim), f"model.embedding_dim={dim} must be a multiple of 4")
    _rejected(DLRMConfig(embedding_dim=dim, dense_arch_widths=[64, dim]),
              f"model.embedding_dim={dim} must be a multiple of 4")


@pytest.mark.parametrize("dim", [4, 8, 12, 132, 256, 260, 384])
def test_multiples_of_four_are_valid(dim):
    InterFormerConfig(embedding_dim=dim, num_heads=4).validate()
    DLRMConfig(embedding_dim=dim, dense_arch_widths=[64, dim]).validate()
