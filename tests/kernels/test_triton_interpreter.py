"""Runs interp_cases.py under Triton's CPU interpreter, in a fresh process.

Why a subprocess: ``triton.jit`` decides at decoration time whether a function is interpreted, and triton's
own library functions (``tl.max``, ``tl.cdiv``...) are decorated when triton is first imported. In a full
test session triton may already have been imported without TRITON_INTERPRET (torch.compile imports it),
so the interpreter only works in a process where the variable is set before that first import.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.triton_interp import needs_triton

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@needs_triton
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/interp_cases.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-500:]
