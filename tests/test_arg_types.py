"""The command-line tools' shared argparse types (loka_trainer.arg_types)."""
from __future__ import annotations

import argparse

import pytest

from loka_trainer.arg_types import feature_pair, non_negative_int, positive_int, writable_dir, writable_file


def test_writable_dir_accepts_a_folder_to_be_made_and_names_what_blocks_one(tmp_path):
    assert writable_dir(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # nothing created while checking
    (tmp_path / "a_file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="a_file is not a directory"):
        writable_dir(str(tmp_path / "a_file" / "out"))


def test_writable_file_accepts_an_existing_file_to_replace_and_rejects_a_folder(tmp_path):
    (tmp_path / "result.json").write_text("{}")
    assert writable_file(str(tmp_path / "result.json")) == tmp_path / "result.json"
    assert writable_file(str(tmp_path / "new" / "result.json")) == tmp_path / "new" / "result.json"
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        writable_file(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="result.json is not a directory"):
        writable_file(str(tmp_path / "result.json" / "x.json"))


def test_counts_reject_too_small_values_and_non_integers():
    assert positive_int("3") == 3 and non_negative_int("0") == 0
    for parse, value, needle in ((positive_int, "0", "must be >= 1, got 0"),
                                 (non_negative_int, "-1", "must be >= 0, got -1"),
                                 (positive_int, "2.5", "not an integer: '2.5'")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            parse(value)


def test_feature_pairs_read_in_x_out_or_in_comma_out_and_reject_the_rest():
    assert feature_pair("4096x2048") == (4096, 2048) and feature_pair("32,64") == (32, 64)
    for bad in ("12x", "0x16", "16x16x16", "ax16", "-16x16"):
        with pytest.raises(argparse.ArgumentTypeError, match="not INxOUT"):
            feature_pair(bad)
