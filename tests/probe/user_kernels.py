"""User GEMMs for ``python -m loka_trainer.probe.report STATS --kernel tests.probe.user_kernels:NAME``."""
from __future__ import annotations

import torch

SATURATION = 8.0
NOT_CALLABLE = 3


def good(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x w^T in fp32 (exact for BF16 operands up to fp32 accumulation)."""
    return x.float() @ w.float().T


def saturating(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bug: clamps the activations to +-8, as a fixed FP8 scale that assumes unit-variance inputs would. Standard
    normal inputs (P(|x| > 8) ~ 1e-15) never notice; learned inputs with outlier features do."""
    return x.float().clamp(-SATURATION, SATURATION) @ w.float().T


def wrong_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float()[:1].T


def raising(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("unsupported shape\nsecond line")
