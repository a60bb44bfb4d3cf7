from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.hashing import hashed_normal
from loka_trainer.data.teacher import Bags, draw_teacher_params, pooled_vectors, solve_bias


@pytest.mark.parametrize("target", [0.03, 0.25, 0.7])
def test_solve_bias_hits_target_ctr(target):
    logits = 2.0 * torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    bias = solve_bias(logits, target)
    assert abs(float(torch.sigmoid(logits.double() + bias).mean()) - target) < 1e-6


def test_pooled_vectors_mean_per_bag_and_zero_for_empty():
    # keys a, b; batch 2; bags: a0=[1, 2], a1=[], b0=[5], b1=[5, 6, 7]
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 5, 5, 6, 7]),
                            lengths=torch.tensor([2, 0, 1, 3], dtype=torch.int32))
    salts = torch.tensor([10, 20])
    out = pooled_vectors(kjt, salts, 3, theta=0.0)
    assert out.shape == (2, 2, 3)  # (B, K, D)
    va, vb = hashed_normal(torch.tensor([1, 2]), 10, 3), hashed_normal(torch.tensor([5, 6, 7]), 20, 3)
    torch.testing.assert_close(out[0, 0], va.mean(0))
    torch.testing.assert_close(out[1, 0], torch.zeros(3))
    torch.testing.assert_close(out[0, 1], vb[0])
    torch.testing.assert_close(out[1, 1], vb.mean(0))
    weighted = pooled_vectors(kjt, salts, 3, theta=0.0, weights=torch.tensor([1.0, 3.0, 1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(weighted[0, 0], (va[0] + 3 * va[1]) / 4)
    torch.testing.assert_close(weighted[1, 1], vb[0])


def test_each_id_gets_its_own_keys_vector_however_often_it_repeats():
    """Ids repeated within and across keys (Zipf batches): every occurrence pools exactly the vector that id has
    under its own key's salt, bit for bit, so the teacher's labels do not depend on what else is in the batch."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 6, (3 * 40,), generator=gen, dtype=torch.int32)  # 3 keys, batch 40
    values = torch.randint(0, 7, (int(lengths.sum()),), generator=gen)  # 7 distinct ids: heavy repetition
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths)
    salts = torch.tensor([11, 12, 13])
    out = pooled_vectors(kjt, salts, 5, theta=0.0)
    starts = torch.cumsum(lengths.long(), 0) - lengths.long()
    for bag, (start, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        key, row = divmod(bag, 40)
        ids = values[start:start + n]
        expected = hashed_normal(ids, salts[key].item(), 5).sum(0) / n if n else torch.zeros(5)
        assert torch.allclose(out[row, key], expected, rtol=0, atol=1e-6), (row, key)
    shared = Bags.of(kjt)  # what a caller pooling kjt twice passes: the same result
    assert torch.equal(pooled_vectors(kjt, salts, 5, theta=0.0, bags=shared), out)
    other_salts = salts + 1
    assert torch.equal(pooled_vectors(kjt, other_salts, 2, 0.0, bags=shared), pooled_vectors(kjt, other_salts, 2, 0.0))
    same_id_two_keys = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([3, 3]),
                                         lengths=torch.ones(2, dtype=torch.int32))
    pooled = pooled_vectors(same_id_two_keys, torch.tensor([11, 12]), 5, theta=0.0)
    assert torch.equal(pooled[0, 0], hashed_normal(torch.tensor([3]), 11, 5)[0])
    assert torch.equal(pooled[0, 1], hashed_normal(torch.tensor([3]), 12, 5)[0])


def test_drift_rotates_id_vectors_but_keeps_their_scale():
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.arange(4000), lengths=torch.ones(4000, dtype=torch.int32))
    salts = torch.tensor([1])
    day0 = pooled_vectors(kjt, salts, 4, theta=0.0)
    later = pooled_vectors(kjt, salts, 4, theta=0.3)
    assert not torch.allclose(day0, later)
    corr = float(torch.corrcoef(torch.stack([day0.flatten(), later.flatten()]))[0, 1])
    assert abs(corr - torch.cos(torch.tensor(0.3)).item()) < 0.05
    assert abs(float(later.std()) - float(day0.std())) < 0.05


def test_teacher_params_depend_on_seed_only():
    kwargs = dict(num_dense=13, num_sparse=26, num_sequences=0, latent_dim=8, drift=0.0)
    a, b, c = (draw_teacher_params(seed=s, **kwargs) for s in (1, 1, 2))
    assert torch.equal(a.w1, b.w1) and torch.equal(a.importance, b.importance) and a.salt("x", 0) == b.salt("x", 0)
    assert not torch.equal(a.w1, c.w1) and a.salt("x", 0) != c.salt("x", 0)
