"""Exact fp32 matmuls inside a block (no TF32 on CUDA), for the references errors are measured against.

torch keeps this as process-wide flags; the context manager sets them for one block and restores them after.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def exact_fp32_matmuls() -> Iterator[None]:
    """fp32 matmuls (and cuDNN convolutions) at full IEEE precision inside the block."""
    old_precision = torch.get_float32_matmul_precision()
    old_cuda, old_cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old_precision)
        torch.backends.cuda.matmul.allow_tf32 = old_cuda
        torch.backends.cudnn.allow_tf32 = old_cudnn
