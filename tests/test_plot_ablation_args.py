"""scripts/plot_ablation and scripts/provenance read their command line: ``--help`` prints the usage and does
nothing else (no regenerated docs files, no digest)."""
from __future__ import annotations

import json
import sys

import pytest

from scripts import plot_ablation, provenance


def test_plot_ablation_help_prints_usage_and_writes_nothing(tmp_path, monkeypatch, capsys):
    reference = tmp_path / "quality.json"
    reference.write_text(json.dumps({"runs": [{"seed": 0, "precision": "bf16", "eval": {"eval_logloss": 0.5}}]}))
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(plot_ablation, "HERE", results)
    monkeypatch.setattr(plot_ablation, "REFERENCE", reference)
    monkeypatch.setattr(sys, "argv", ["plot_ablation.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        plot_ablation.main()
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m scripts.plot_ablation [-h]")
    assert list(results.iterdir()) == []


def test_provenance_help_prints_usage_not_a_digest(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["provenance.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        provenance.main()
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m scripts.provenance [-h]") and provenance.source_digest() not in out
