"""Where Triton kernels can run in this process: triton importable, CUDA tensors, or Triton's CPU interpreter.

The ground floor of the Triton code: the quantizers, the PDL launch keywords and the Mods kernels all ask here,
and this module imports none of them (nor triton itself).
"""
from __future__ import annotations

import importlib.util
import os

import torch
from torch._subclasses.fake_tensor import is_fake


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


def traced(t: torch.Tensor) -> bool:
    """True if ``t`` belongs to a graph being traced (torch.compile, export): dynamo at work, or a fake tensor (a
    ``triton_op``'s body traced by AOTAutograd)."""
    # a plain tensor is never fake: skips is_fake's checks (~2 µs) on every eager launch
    return torch.compiler.is_compiling() or (type(t) is not torch.Tensor and is_fake(t))


def launcher(kernel, t: torch.Tensor):
    """``kernel`` (a Triton JIT or autotuned kernel) ready for ``[grid](...)`` on tensors like ``t``: wrapped by
    ``torch.library.wrap_triton`` when ``t`` is traced (inductor then launches the kernel from its own code), else the
    kernel itself: an eager launch through the wrapper's higher-order op took 406 µs of host time per quantization
    on the H200 against 72 µs launched directly (``benchmarks/quant_op_host_time_gpu.py``, its custom_op row)."""
    if traced(t):
        from torch.library import wrap_triton
        return wrap_triton(kernel)
    return kernel
