"""Where Triton kernels can run in this process: triton importable, CUDA tensors, or Triton's CPU interpreter.

The ground floor of the Triton code: the quantizers, the PDL launch keywords and the Mods kernels all ask here,
and this module imports none of them (nor triton itself).
"""
from __future__ import annotations

import importlib.util
import os

import torch


# NOTE: checked once at import (without importing triton): ``use_triton`` runs inside torch.compile'd code, and
# dynamo cannot trace ``importlib.util.find_spec`` (each call was a graph break, 67 per Wukong training step).
_TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def triton_importable() -> bool:
    """True if triton can be imported."""
    return _TRITON_IMPORTABLE


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``): kernels accept CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True if Triton kernels can run on ``t``'s device in this process."""
    if t.is_cuda:
        return _TRITON_IMPORTABLE
    # is_compiling first: compiled code never traces the environment lookup of interpreting()
    return _TRITON_IMPORTABLE and not torch.compiler.is_compiling() and interpreting()
