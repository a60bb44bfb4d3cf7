"""Files written whole or not at all (loka_trainer.atomic_files)."""
from __future__ import annotations

import os

import pytest

from loka_trainer.atomic_files import atomic_copy, atomic_write, atomic_write_text


def test_a_write_that_fails_halfway_leaves_the_previous_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"steps": 10}\n')

    def half_then_fail(f):
        f.write(b'{"steps": 2')
        raise OSError("no space left on device")

    with pytest.raises(OSError, match="no space left"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == '{"steps": 10}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_text_and_copies_replace_the_file_readable_by_others_and_make_its_folder(tmp_path):
    path = atomic_write_text(tmp_path / "a" / "b" / "plan.json", "{}\n")
    assert path.read_text() == "{}\n" and oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    atomic_write_text(path, "[]\n")
    copy = atomic_copy(path, tmp_path / "copy.json")
    assert copy.read_text() == "[]\n" and sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]
