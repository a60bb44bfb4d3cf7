"""How the dense optimizer's step is shaped: linear learning-rate warm-up (``trainer.warmup_steps``) and clipping of
the dense gradient's norm (``trainer.grad_clip_norm``). Both are off by default. Embeddings are not affected: their
fused TorchRec optimizer updates the tables inside backward.

The warm-up is a pure function of the step (`warmup_factor`), run by torch's ``LambdaLR``; a resumed run rebuilds it
at the checkpoint's step, so nothing extra is saved. Clipping is ``torch.nn.utils.clip_grad_norm_``, whose norm of
FSDP2's DTensor gradient shards is reduced over the mesh, so every rank scales by the same factor.
"""
from __future__ import annotations

import functools
from typing import Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Learning-rate multiplier of 0-based step `step`: (step + 1) / warmup_steps for the first `warmup_steps` steps,
    then 1 (also when `warmup_steps` is 0)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def build_warmup(optimizer: torch.optim.Optimizer, *, base_lr: float, warmup_steps: int,
                 start_step: int) -> Optional[LambdaLR]:
    """The warm-up schedule of `optimizer` for a run that starts at 0-based step `start_step` (0, or a resumed
    checkpoint's step): the learning rate is set for that step now; call ``.step()`` once after every training
    step, skipped ones included. None when `warmup_steps` is 0; the learning rate is then `base_lr` (also after a
    resume from a checkpoint saved during a warm-up)."""
    if warmup_steps <= 0:
        for group in optimizer.param_groups:
            group["lr"] = base_lr
        return None
    for group in optimizer.param_groups:
        group["initial_lr"] = base_lr  # LambdaLR scales this; set here so a resume needs nothing from the checkpoint
    return LambdaLR(optimizer, functools.partial(warmup_factor, warmup_steps=warmup_steps), last_epoch=start_step - 1)


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` (those without one are ignored) so that their total 2-norm over all ranks is
    at most `max_norm`; returns the norm before clipping as a 0-dim local tensor (no host sync)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


__all__ = ["build_warmup", "clip_gradients", "warmup_factor"]
