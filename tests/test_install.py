"""A non-editable install (what ``pip install .`` puts in site-packages) trains from outside the source tree."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import SMALL

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_package_trains_outside_the_source_tree(tmp_path):
    # Build from a copy so that setuptools' build/ and egg-info stay out of the checkout.
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copytree(ROOT / "loka_trainer", source / "loka_trainer", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)], check=True, timeout=300)
    shutil.rmtree(source)
    assert (site / "bin" / "loka-train").is_file()

    elsewhere, run_dir = tmp_path / "elsewhere", tmp_path / "run"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LOKA_CONF_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)  # stands for site-packages: the heavy dependencies come from this interpreter
    where = subprocess.run([sys.executable, "-c", "import loka_trainer; print(loka_trainer.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(site)
    proc = subprocess.run([sys.executable, "-m", "loka_trainer.train", "model=dlrm", "trainer.steps=2",
                           "trainer.log_interval=1", f"hydra.run.dir={run_dir}", *SMALL], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
