"""scripts.bench_user_path: the fused layer as a user gets it (public API + Dispatch), run on CPU at tiny shapes
(times are meaningless there), its kernel diff and its resume."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_user_path_bench_times_every_variant_through_the_public_api(tmp_path):
    """The user-path benchmark runs on CPU at a tiny shape: every variant timed, ratios against the published
    layer, JSON and PNG written (its numbers only mean something on a GPU)."""
    cmd = [sys.executable, "-m", "scripts.bench_user_path", str(tmp_path), "--shapes", "32,64", "--batch", "32",
           "--device", "cpu", "--best-of-modes"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "user_path.json").read_text())
    [row] = result["rows"]
    assert set(row["us"]) == {"published", "published_compiled", "mods_compiled", "loka_eager", "loka_compiled",
                              "loka_eager_cast_reused", "loka_eager_plan_compiled", "best_of_modes"}
    assert set(row["kernels"]) == {"loka_eager", "loka_compiled", "best_of_modes"}
    from scripts.bench_user_path import BEST_OF
    assert row["kernels"]["best_of_modes"]["variant"] in BEST_OF and len(BEST_OF) > 1
    assert "best_of_modes" in result["geomean_vs_published"]
    assert all(t > 0 for t in row["us"].values())
    assert result["geomean_vs_published"]["published"] == 1.0
    assert (tmp_path / "user_path.png").stat().st_size > 0
    assert "LoKA compiled / plain Mods compiled" in proc.stdout.splitlines()[-1]
    assert result["command"] == (f"python -m scripts.bench_user_path {tmp_path} --shapes 32,64 --batch 32 --device cpu"
                                 " --best-of-modes")
    assert result["date"] and result["commit"] and "torch" in result


def test_kernel_diff_lists_what_the_compiled_step_adds():
    """Kernels only in the second list, launched more often or running longer there; the largest extra first."""
    from scripts.bench_user_path import kernel_diff
    eager = [["gemm_a", 10.0, 2], ["norm_fwd", 3.0, 1], ["copy_", 1.0, 1], ["faster", 0.9, 1]]
    compiled = [["gemm_a", 10.0, 2], ["norm_fwd", 3.0, 1], ["copy_", 2.5, 3], ["triton_poi_cast", 1.2, 1],
                ["faster", 0.5, 1]]
    assert kernel_diff(eager, compiled) == [["copy_", 1.5, 2], ["triton_poi_cast", 1.2, 1]]  # not "faster"
    assert kernel_diff(compiled, compiled) == []


def test_user_path_bench_refuses_kernels_on_cpu(tmp_path):
    """--kernels profiles CUDA kernels: on a CPU device it stops with one usage line before building anything."""
    cmd = [sys.executable, "-m", "scripts.bench_user_path", str(tmp_path), "--device", "cpu", "--kernels"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--kernels profiles GPU kernels" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "user_path.json").exists()


def test_user_path_resume_keeps_rows_of_the_same_code_only(tmp_path):
    """--resume reads back an interrupted run's rows; rows of other code or another batch stop the run with the
    reason and stay as they were."""
    from scripts.bench_user_path import resumed_rows
    from scripts.provenance import source_digest
    path, source = tmp_path / "user_path.json", source_digest()
    assert resumed_rows(path, 1024, source) == []
    row = {"K": 256, "N": 256, "us": {"published": 20.0}}
    path.write_text(json.dumps({"source": source, "batch": 1024, "rows": [row]}))
    assert resumed_rows(path, 1024, source) == [row]
    with pytest.raises(SystemExit, match="batch 1024, this run is .* batch 512"):
        resumed_rows(path, 512, source)
    path.write_text(json.dumps({"source": "0123456789ab", "batch": 1024, "rows": [row]}))
    with pytest.raises(SystemExit, match="rows of source 0123456789ab"):
        resumed_rows(path, 1024, source)
    assert json.loads(path.read_text())["rows"] == [row]
