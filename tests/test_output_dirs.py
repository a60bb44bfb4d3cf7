"""Whether a run can write where it is told to (``loka_trainer.output_dirs.unwritable_reason``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from loka_trainer.output_dirs import unwritable_reason


def test_a_writable_dir_and_a_missing_one_below_it_pass_leaving_nothing_behind(tmp_path):
    assert unwritable_reason(tmp_path) is None
    assert unwritable_reason(tmp_path / "a" / "b") is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_dir_under_proc_is_refused_though_its_permission_bits_allow_writing():
    """trainer.checkpoint_dir=/proc/x passed, as root, and failed creating the directory at the first save."""
    assert unwritable_reason(Path("/proc/loka_checkpoints")) == ("cannot create a file in /proc: No such file or "
                                                            "directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_dir_is_refused(tmp_path):
    tmp_path.chmod(0o555)
    try:
        assert unwritable_reason(tmp_path / "ckpt") == f"{tmp_path} is not writable"
    finally:
        tmp_path.chmod(0o755)


def test_a_file_in_the_path_is_refused(tmp_path):
    (tmp_path / "a_file").write_text("")
    assert unwritable_reason(tmp_path / "a_file" / "out") == f"{tmp_path / 'a_file'} is not a directory"
