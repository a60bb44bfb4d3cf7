from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp

from loka_trainer.metrics import CTRMetrics, auc, ctr_metrics, log_loss, normalized_entropy
from tests.spawn import run_on_ranks


def test_auc_hand_computed_with_a_tie():
    # positives score 0.9, 0.4, 0.6(tie with a negative); negatives 0.6, 0.2.
    # pairs (pos > neg): 0.9>0.6, 0.9>0.2, 0.4>0.2, 0.6=0.6 (half), 0.6>0.2, 0.4<0.6 -> 4.5 of 6.
    scores = torch.tensor([0.9, 0.4, 0.6, 0.6, 0.2])
    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    assert auc(scores, labels) == pytest.approx(4.5 / 6)


def test_auc_is_rank_based_and_nan_for_one_class():
    scores = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    labels = (scores > 0).float()
    assert auc(scores, labels) == pytest.approx(1.0)
    assert auc(torch.exp(scores), labels) == pytest.approx(1.0)
    assert auc(-scores, labels) == pytest.approx(0.0)
    assert math.isnan(auc(scores, torch.ones(1000)))


def test_one_class_gives_a_log_loss_and_no_ne_or_auc():
    logits, labels = torch.tensor([2.0, -1.0, 0.5]), torch.zeros(3)
    values = ctr_metrics(logits, labels)
    assert values["logloss"] == pytest.approx(log_loss(logits, labels)) and values["logloss"] > 0
    assert math.isnan(values["ne"]) and math.isnan(values["auc"])  # NE's denominator, the base rate's entropy, is 0


def test_log_loss_and_ne_hand_computed():
    logits = torch.tensor([0.0, math.log(3.0)])  # p = 0.5, 0.75
    labels = torch.tensor([1.0, 0.0])
    expected = -(math.log(0.5) + math.log(0.25)) / 2
    assert log_loss(logits, labels) == pytest.approx(expected)
    assert normalized_entropy(logits, labels) == pytest.approx(expected / math.log(2))


def test_ne_of_base_rate_predictor_is_one():
    labels = torch.tensor([1.0] * 30 + [0.0] * 70)
    p = 0.3
    logits = torch.full((100,), math.log(p / (1 - p)))
    assert normalized_entropy(logits, labels) == pytest.approx(1.0, rel=1e-9)


def test_ctr_metrics_prefix():
    m = ctr_metrics(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0]), prefix="eval_")
    assert set(m) == {"eval_logloss", "eval_ne", "eval_auc"} and m["eval_auc"] == 1.0


def test_auc_counts_ties_between_classes_as_one_half():
    # bf16 logits tie often; every positive ties with one negative: AUC = 1/2 exactly, whatever the sort order.
    scores = torch.tensor([0.5, 0.5, -1.0, -1.0, 2.0, 2.0])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert auc(scores, labels) == pytest.approx(0.5)


def test_distinct_large_logits_stay_distinct():
    # sigmoid in fp32 rounds all of these to 1.0 (an AUC of 1/2); the metric must still rank them.
    logits = torch.tensor([17.0, 18.0, 19.0, 20.0])
    assert auc(logits, torch.tensor([0.0, 0.0, 1.0, 1.0])) == pytest.approx(1.0)


def test_reset_starts_a_new_window():
    metrics = CTRMetrics()
    metrics.update(torch.tensor([3.0, -3.0]), torch.tensor([0.0, 1.0]))  # AUC 0
    metrics.reset()
    metrics.update(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 0.0, 0.0]))
    values = metrics.compute()
    assert values["examples"] == 3 and values["auc"] == pytest.approx(1.0)
    assert values["logloss"] == pytest.approx(log_loss(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 0.0, 0.0])))


def _two_rank_metrics(rank: int, logits: torch.Tensor, labels: torch.Tensor, split: int, out) -> None:
    mine = slice(0, split) if rank == 0 else slice(split, None)
    metrics = CTRMetrics()
    for chunk_logits, chunk_labels in zip(logits[mine].split(7), labels[mine].split(7)):
        metrics.update(chunk_logits, chunk_labels)
    out[rank] = metrics.compute()


@pytest.mark.slow
def test_two_ranks_with_uneven_shares_match_one_process():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(101, generator=g).to(torch.bfloat16).float()  # ties across ranks
    labels = (torch.rand(101, generator=g) < torch.sigmoid(logits)).float()
    with mp.Manager() as manager:
        out = manager.dict()
        run_on_ranks(_two_rank_metrics, 2, logits, labels, 30, out)
        results = dict(out)
    expected = ctr_metrics(logits, labels)
    for rank in (0, 1):
        assert results[rank]["examples"] == 101
        for key in ("logloss", "ne", "auc"):
            assert results[rank][key] == pytest.approx(expected[key], rel=1e-9), (rank, key)
