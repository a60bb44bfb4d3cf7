from __future__ import annotations

import math

import pytest
import torch

from loka_trainer.metrics import auc, base_rate_entropy, ctr_metrics, log_loss, normalized_entropy


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
    assert base_rate_entropy(0.0) > 0  # clamped, no division by zero


def test_ctr_metrics_prefix():
    m = ctr_metrics(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0]), prefix="eval_")
    assert set(m) == {"eval_logloss", "eval_ne", "eval_auc"} and m["eval_auc"] == 1.0
