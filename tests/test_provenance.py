"""Every benchmark JSON says where it came from (scripts/provenance.py)."""
from __future__ import annotations

import subprocess
import sys

import shutil

from scripts.provenance import ROOT, command_line, git_state, provenance, source_digest


def test_a_repository_script_is_written_as_the_module_a_user_runs():
    assert command_line([str(ROOT / "scripts" / "bench_user_path.py"), "OUT", "--batch", "8"]) == \
        "python -m scripts.bench_user_path OUT --batch 8"
    assert command_line(["/elsewhere/tool.py", "x"]) == "python /elsewhere/tool.py x"
    assert command_line(["-c"]) == "python -c"


def test_the_commit_is_heads_and_outside_git_there_is_none(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    commit, dirty = git_state()
    assert commit == head.stdout.strip() and isinstance(dirty, bool)
    assert git_state(tmp_path) == (None, None)


def test_a_tracked_change_marks_the_state_dirty(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    assert git_state(tmp_path)[1] is False
    (tmp_path / "untracked.txt").write_text("ignored")  # untracked files do not change what ran
    assert git_state(tmp_path)[1] is False
    (tmp_path / "a.txt").write_text("2")
    assert git_state(tmp_path)[1] is True


def test_provenance_has_every_field_for_this_process():
    meta = provenance([sys.argv[0]])
    assert set(meta) == {"date", "commit", "dirty", "source", "device", "torch", "triton", "command"}
    assert meta["torch"] and meta["device"] and len(meta["date"]) == 10


def test_the_source_digest_names_the_code_not_the_checkout(tmp_path):
    """Two copies of the same code agree without any git metadata; a changed package file or train.py changes it;
    files outside the code (docs, results) do not."""
    for name in ("train.py", "loka_trainer"):
        src = ROOT / name
        (shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, tmp_path / name))
    assert source_digest(tmp_path) == source_digest(ROOT) and len(source_digest(ROOT)) == 12
    (tmp_path / "README.md").write_text("results")
    assert source_digest(tmp_path) == source_digest(ROOT)
    with (tmp_path / "loka_trainer" / "precision.py").open("a") as f:
        f.write("\n")
    changed = source_digest(tmp_path)
    assert changed != source_digest(ROOT)
    (tmp_path / "train.py").write_text("")
    assert source_digest(tmp_path) not in (changed, source_digest(ROOT))
