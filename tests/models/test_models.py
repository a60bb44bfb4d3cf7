"""Conformance of every registered model: shapes, gradients, learning, FSDP2 units."""
from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from loka_trainer.data.batch import Batch
from loka_trainer.models.zoo import MODELS, build_model

NAMES = sorted(MODELS)


def _embedding_params(model: torch.nn.Module) -> dict[int, str]:
    return {
        id(p): name
        for name, module in model.named_modules()
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection))
        for p in module.parameters()
    }


@pytest.mark.parametrize("loka_mods", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_output_is_one_logit_per_example(name, loka_mods, schema, batch, small_config):
    model = build_model(small_config(name), schema=schema, loka_mods=loka_mods)
    logits = model(batch)
    assert logits.shape == (len(batch),) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_embeddings_live_in_sparse_arch(name, schema, small_config):
    model = build_model(small_config(name), schema=schema, loka_mods=False)
    owners = set(_embedding_params(model).values())
    assert owners and all(owner.startswith("sparse_arch.") for owner in owners)


@pytest.mark.parametrize("loka_mods", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_gradient_reaches_every_parameter(name, loka_mods, schema, batch, small_config):
    torch.manual_seed(0)
    model = build_model(small_config(name), schema=schema, loka_mods=loka_mods)
    torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"no gradient reaches {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_dense_units_cover_every_non_embedding_parameter_once(name, schema, small_config):
    model = build_model(small_config(name), schema=schema, loka_mods=True)
    embedding = _embedding_params(model)
    seen: dict[int, int] = {}
    for unit in model.dense_units():
        assert not isinstance(unit, (EmbeddingBagCollection, EmbeddingCollection))
        for p in unit.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    dense = {id(p) for p in model.parameters() if id(p) not in embedding}
    assert set(seen) == dense, "a dense parameter is outside every unit, or an embedding is inside one"
    assert all(count == 1 for count in seen.values()), "a parameter belongs to two units"


def _planted_task(make_schema, make_batch, *, num_examples: int) -> tuple:
    """Labels from a fixed teacher: per-id weights of two sparse features plus a dense feature."""
    schema = make_schema(num_sparse=6, vocab=20, num_dense=4, num_seq=2)
    batch = make_batch(schema, num_examples, seed=1, multi_hot=1)
    teacher = torch.Generator().manual_seed(2)
    w0, w1 = torch.randn(20, generator=teacher), torch.randn(20, generator=teacher)
    score = 2 * w0[batch.sparse["c0"].values()] + 2 * w1[batch.sparse["c1"].values()] + 1.5 * batch.dense[:, 0]
    return schema, Batch(batch.dense, batch.sparse, (score > 0).float(), batch.sequences)


@pytest.mark.parametrize("loka_mods", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_loss_falls_on_a_planted_signal(name, loka_mods, make_schema, make_batch, small_config):
    torch.manual_seed(0)
    schema, batch = _planted_task(make_schema, make_batch, num_examples=256)
    model = build_model(small_config(name), schema=schema, loka_mods=loka_mods)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
