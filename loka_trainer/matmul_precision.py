"""The precision of fp32 matmuls inside a block: exact IEEE fp32, or TF32 tensor cores on CUDA.

torch keeps this as process-wide flags; these context managers set them for one block and restore them after.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def fp32_matmuls(*, tf32: bool) -> Iterator[None]:
    """fp32 matmuls (and cuDNN convolutions) in TF32 when ``tf32``, else at full precision, inside the block."""
    old_precision = torch.get_float32_matmul_precision()
    old_cuda, old_cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old_precision)
        torch.backends.cuda.matmul.allow_tf32 = old_cuda
        torch.backends.cudnn.allow_tf32 = old_cudnn
