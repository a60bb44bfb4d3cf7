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
