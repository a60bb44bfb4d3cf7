"""`script_main`: the process entry point ends with main's exit status, after atexit handlers and flushed output."""
from __future__ import annotations

import subprocess
import sys

import pytest

from loka_trainer.launch import exit_status
from tests.launch import ROOT

ENDS_WITH = """
import atexit, sys
from loka_trainer import launch
atexit.register(lambda: print("atexit ran"))
def main():
    sys.stdout.write("unflushed line")  # no newline: still in the buffer when the process ends
    {end}
launch.main = main
launch.script_main()
"""


@pytest.mark.parametrize("end, status", [("pass", 0), ("raise SystemExit(3)", 3), ("raise SystemExit('bad')", 1)])
def test_script_main_exits_with_mains_status_after_atexit_handlers_and_flushed_output(end, status):
    proc = subprocess.run([sys.executable, "-c", ENDS_WITH.format(end=end)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert proc.stdout == "unflushed lineatexit ran\n"
    assert proc.stderr == ("bad\n" if status == 1 else "")


def test_script_main_lets_a_crash_propagate_with_its_traceback():
    script = ENDS_WITH.format(end="raise RuntimeError('boom')")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "RuntimeError: boom" in proc.stderr


def test_exit_status_follows_pythons_rules(capsys):
    assert [exit_status(None), exit_status(0), exit_status(130)] == [0, 0, 130]
    assert exit_status("error: x") == 1
    assert capsys.readouterr().err == "error: x\n"
