"""``python -m loka_trainer.bench`` end to end, against a throwaway conf dir (the real model/data groups are
tested by their owners; here the example provider keeps the run small)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def conf_dir(tmp_path: Path) -> Path:
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "data").mkdir()
    shutil.copy(ROOT / "conf" / "bench.yaml", conf / "bench.yaml")
    (conf / "model" / "dlrm.yaml").write_text("name: dlrm\n")
    (conf / "data" / "synthetic.yaml").write_text("name: synthetic\nbatch_size: 4\n")
    return conf


def _run(conf_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LOKA_CONF_DIR=str(conf_dir))
    return subprocess.run([sys.executable, "-m", "loka_trainer.bench", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_table_and_icicle(conf_dir, tmp_path):
    out = tmp_path / "run"
    proc = _run(conf_dir, "bench.provider=example", "bench.example=mlp_tree", "bench.depth=2",
                "bench.repeats=1", "bench.warmup=0", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "bench_mlp_tree.csv").read_text().count("\n") == 1 + 9  # header + 9 modules
    assert "model.left.2" in (out / "bench_mlp_tree_icicle.html").read_text()
    assert "bench:" in proc.stderr  # tqdm progress bar over submodules


def test_cli_bad_option_is_one_line_exit_2(conf_dir, tmp_path):
    proc = _run(conf_dir, "bench.provider=example", "bench.color_by=rainbow", f"hydra.run.dir={tmp_path}/r")
    assert proc.returncode == 2
    assert "bench.color_by" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
