"""docs/api.md's Python snippets run as written (in a temporary working directory)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", API_DOC.read_text(), flags=re.S)


def test_the_api_doc_has_the_four_adoption_snippets():
    assert len(SNIPPETS) == 4


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_api_doc_snippet_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(SNIPPETS[index], f"docs/api.md snippet {index}", "exec"), {})
    runs = tmp_path / "runs" / "readme"
    expected = [runs / "probe" / "stats.pt", runs / "dispatch_plan.json", runs / "declared" / "dispatch_plan.json",
                runs / "bench"][index]
    assert expected.exists()


README = Path(__file__).resolve().parents[1] / "README.md"
OWN_TRAINER = re.search(r"## LoKA in the trainer you already have\n\n```py\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_own_trainer_snippet_runs_on_a_model_and_batch_of_yours(tmp_path, monkeypatch):
    import torch
    from torch import nn

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.LayerNorm(256), nn.ReLU(), nn.Linear(256, 1))
    batch = torch.randn(256, 128)
    scope = {"model": model, "batch": batch}
    exec(compile(OWN_TRAINER.group(1), "README.md own-trainer snippet", "exec"), scope)
    probe, state, opt = scope["probe"], scope["state"], scope["opt"]
    for step in range(2):  # "then per step: on_step_start(state), your step, on_step_end(state)"
        state.step = step
        probe.on_step_start(state)
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
        probe.on_step_end(state)
    probe.on_train_end(state)
    assert (tmp_path / "runs" / "my" / "dispatch_plan.json").exists()
    assert (tmp_path / "runs" / "my" / "probe" / "stats.pt").exists()
