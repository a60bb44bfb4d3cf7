from __future__ import annotations

import json

import pytest
import torch

from loka_trainer.data.stats import bayes_metrics, head_coverage, main, rank_auc

from .helpers import rank_auc as reference_auc


def test_rank_auc_matches_pairwise_definition():
    gen = torch.Generator().manual_seed(0)
    scores, labels = torch.randn(300, generator=gen), (torch.rand(300, generator=gen) < 0.3).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = float((pos[:, None] > neg[None, :]).double().mean())
    assert abs(rank_auc(scores, labels) - pairwise) < 1e-12
    assert abs(reference_auc(scores, labels) - pairwise) < 1e-12
    coarse = scores.round()  # many ties: each tied (pos, neg) pair counts one half
    pairwise_ties = float(((pos.round()[:, None] > neg.round()[None, :]).double()
                           + 0.5 * (pos.round()[:, None] == neg.round()[None, :]).double()).mean())
    assert abs(rank_auc(coarse, labels) - pairwise_ties) < 1e-12


def test_bayes_metrics_of_perfectly_calibrated_noise_free_scores():
    labels = torch.tensor([0.0, 1.0] * 50)
    sure = bayes_metrics((labels * 2 - 1) * 30, labels)
    assert sure["auc"] == 1.0 and sure["log_loss"] < 1e-9 and sure["ne"] < 1e-9
    constant = bayes_metrics(torch.zeros(100), labels)  # logit 0 at CTR 0.5 is the entropy itself
    assert abs(constant["ne"] - 1.0) < 1e-9 and constant["auc"] == pytest.approx(0.5)


def test_head_coverage():
    ids = torch.tensor([7] * 90 + list(range(100, 110)) * 1)
    assert head_coverage(ids, top_fraction=0.01) == pytest.approx(0.9)


def test_cli_writes_json_and_png(tmp_path):
    summary = main(["--out", str(tmp_path), "--batches", "4", "batch_size=256", "num_sequences=1",
                    "max_vocab_size=5000", "pin_memory=false"])
    written = json.loads((tmp_path / "data_stats.json").read_text())
    assert written["num_rows"] == 1024 and written["config"]["pin_memory"] is False
    assert 0.7 < written["bayes"]["auc"] < 0.9 and 0.15 < written["bayes"]["ctr"] < 0.35
    assert summary["sparse"]["cat_2"]["vocab"] == 5000
    assert (tmp_path / "data_stats.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="unknown data field 'batchsize'"):
        main(["--out", str(tmp_path), "batchsize=3"])
