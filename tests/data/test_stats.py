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


@pytest.mark.parametrize("override, message", [
    ("batchsize=3", "unknown data field 'batchsize'"),
    ("batch_size=abc", "batch_size must be an integer, got 'abc'"),
    ("outliers.hot_scale=big", "outliers.hot_scale must be a number, got 'big'"),
    ("batch_size=0", "data.batch_size must be > 0, got 0"),
])
def test_cli_names_a_bad_override_in_one_line(tmp_path, capsys, override, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), override])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: {message}" in error and not (tmp_path / "data_stats.json").exists()


def test_cli_sets_the_outlier_regime_by_dotted_key(tmp_path):
    summary = main(["--out", str(tmp_path), "--batches", "2", "batch_size=256", "outliers.hot_features=2",
                    "outliers.hot_scale=100"])
    assert summary["config"]["outliers"]["hot_features"] == 2
    assert max(summary["dense_quantiles"][0.5]) > 50  # a hot channel's median count, times 100
