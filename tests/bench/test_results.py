from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from loka_trainer.bench import ExampleProvider, run_bench, write_results
from loka_trainer.bench.icicle import icicle_figure
from scripts import screenshot_icicle

HAS_CHROMIUM = Path("/usr/bin/chromium").exists()


@pytest.fixture(scope="module")
def nanogpt_result():
    from loka_trainer.bench import BenchOptions

    opts = BenchOptions(depth=3, warmup=0, repeats=1, progress=False)
    return run_bench(ExampleProvider("nanogpt", batch_size=2).get_component(torch.device("cpu")), opts)


def test_table_files_have_the_paper_columns_and_na(nanogpt_result, tmp_path):
    paths = write_results(nanogpt_result, tmp_path, ["csv", "json", "markdown"], stem="t")
    assert [p.name for p in paths] == ["t.csv", "t.json", "t.md"]
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["component_name"] for r in rows] == list(nanogpt_result.nodes)
    for col in ("latency_fwd_ms", "model_size_mb", "tflops_per_s", "mfu_pct", "peak_tflops", "est_bw_gbps",
                "bw_util_pct", "cpu_time_total_ms", "gpu_time_total_ms"):
        assert col in rows[0]
    assert rows[0]["mfu_pct"] == "n/a" and float(rows[0]["latency_fwd_ms"]) > 0  # CPU: no stated peak
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["header"]["peak"].startswith("unknown") and len(data["nodes"]) == len(rows)
    assert "| model.lm_head |" in (tmp_path / "t.md").read_text()


def test_icicle_is_offline_and_values_are_consistent(nanogpt_result, tmp_path):
    (path,) = write_results(nanogpt_result, tmp_path, ["icicle"], stem="t")
    html = path.read_text()
    assert not re.search(r'<script[^>]+src="https?://', html)  # plotly.js is inlined, no CDN
    assert "model.h.0.attn" in html
    trace = icicle_figure(nanogpt_result).data[0]
    value = dict(zip(trace.ids, trace.values))
    for node in nanogpt_result.bfs():
        assert value[node.path] >= sum(value[c] for c in node.children) - 1e-12  # branchvalues="total" safe


def test_tensorboard_result_writes_events(nanogpt_result, tmp_path):
    (log_dir,) = write_results(nanogpt_result, tmp_path, ["tensorboard"], stem="t")
    assert any(p.name.startswith("events.out.tfevents") for p in log_dir.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tensorboard"]  # only the files it names


@pytest.mark.skipif(not HAS_CHROMIUM, reason="needs Debian's chromium at /usr/bin/chromium")
def test_icicle_renders_in_headless_chromium(nanogpt_result, tmp_path):
    (path,) = write_results(nanogpt_result, tmp_path, ["icicle"], stem="t")
    dom = screenshot_icicle.dump_dom(path)
    assert "class=\"main-svg\"" in dom  # plotly drew its SVG, offline
    for label in ("lm_head", "attn", "wte"):
        assert f">{label}<" in dom, label
    png = screenshot_icicle.screenshot(path, tmp_path / "shot.png", size="800,600")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def _earlier_run(run_dir: Path) -> list[str]:
    """Files an earlier benchmark run leaves in ``run_dir`` (command line and `write_results`), then two of the
    user's; their relative paths."""
    files = [".hydra/config.yaml", "traces/model.0/host_1.pt.trace.json", "memory_snapshots/model/snapshot.pickle",
             "tensorboard/events.out.tfevents.1", "bench_dlrm.csv", "bench_dlrm.json", "bench_dlrm.md",
             "bench_dlrm_icicle.html", "bench.csv", "bench_icicle.html", "bench_notes.txt", "notes.txt"]
    for name in files:
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    return files


def test_an_earlier_runs_outputs_move_to_previous_and_nothing_is_deleted(tmp_path):
    from loka_trainer.bench.results import earlier_run_set_aside

    files, lines = _earlier_run(tmp_path), []
    with earlier_run_set_aside(tmp_path, lines.append):
        [dest] = (tmp_path / "previous").iterdir()
        assert not (tmp_path / "traces").exists()  # the run writes its traces into an empty folder
        (tmp_path / "bench_dlrm.csv").write_text("new")
    assert lines == [f"the earlier run's outputs (.hydra, traces, memory_snapshots, tensorboard, bench.csv, "
                     f"bench_dlrm.csv, bench_dlrm.json, bench_dlrm.md, bench_dlrm_icicle.html, bench_icicle.html) "
                     f"were moved to {dest}"]
    for name in files[:-2]:
        assert (dest / name).read_text() == name
    assert (tmp_path / "bench_dlrm.csv").read_text() == "new"
    for name in files[-2:]:  # not the benchmark's: stay
        assert (tmp_path / name).read_text() == name
    lines.clear()
    with earlier_run_set_aside(tmp_path / "new", lines.append):
        pass
    assert lines == [] and not (tmp_path / "new").exists()


def test_a_failed_rerun_leaves_the_earlier_outputs_where_they_were(tmp_path):
    from loka_trainer.bench.results import earlier_run_set_aside

    files, lines = _earlier_run(tmp_path), []
    with pytest.raises(RuntimeError, match="boom"), earlier_run_set_aside(tmp_path, lines.append):
        (tmp_path / "traces" / "model.1").mkdir(parents=True)
        (tmp_path / "traces" / "model.1" / "half.pt.trace.json").write_text("half")
        raise RuntimeError("boom")
    for name in files:
        assert (tmp_path / name).read_text() == name
    assert not (tmp_path / "traces" / "model.1").exists()
    [aside] = (tmp_path / "previous").iterdir()  # the failed run's partial traces, kept
    assert (aside / "traces" / "model.1" / "half.pt.trace.json").read_text() == "half"
    assert lines == [f"the failed run's outputs (traces) were moved to {aside}"]
    with pytest.raises(KeyboardInterrupt), earlier_run_set_aside(tmp_path, lines.append):
        raise KeyboardInterrupt
    assert [p.name for p in (tmp_path / "previous").iterdir()] == [aside.name]  # nothing written: no folder left
    for name in files:
        assert (tmp_path / name).read_text() == name
