"""scripts/screenshot_icicle's command line: a missing HTML file or a bad ``--size`` is argparse's error (exit 2)
before Chromium starts."""
from __future__ import annotations

import argparse

import pytest

from scripts import screenshot_icicle


@pytest.fixture(autouse=True)
def _no_chromium(monkeypatch):
    """Any call that reached Chromium would fail the test."""
    monkeypatch.setattr(screenshot_icicle, "find_chromium", lambda: pytest.fail("Chromium was started"))


def test_a_missing_html_is_file_not_found(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        screenshot_icicle.main([str(tmp_path / "missing.html")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"argument html: {tmp_path}/missing.html: file not found")


@pytest.mark.parametrize("size", ["abc", "0,900", "1400", "1400,900,3"])
def test_a_bad_size_is_refused(tmp_path, capsys, size):
    (tmp_path / "a.html").write_text("<html></html>")
    with pytest.raises(SystemExit) as stop:
        screenshot_icicle.main([str(tmp_path / "a.html"), "--size", size])
    assert stop.value.code == 2
    assert f"argument --size: not W,H (two positive integers): {size!r}" in capsys.readouterr().err


def test_sizes_read_as_w_comma_h_or_w_x_h(tmp_path):
    assert screenshot_icicle.window_size("1400,900") == "1400,900"
    assert screenshot_icicle.window_size("800x600") == "800,600"
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory, not a file"):
        screenshot_icicle.existing_file(str(tmp_path))


def test_the_function_refuses_a_missing_html_in_one_line(tmp_path):
    with pytest.raises(RuntimeError, match=r"missing.html: file not found$"):
        screenshot_icicle.screenshot(tmp_path / "missing.html", tmp_path / "shot.png")
