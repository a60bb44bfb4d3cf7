"""Calibration: what each target Linear sees on one real batch (its input, its row counts), read by forward
pre-hooks that change nothing; the model's buffers (BatchNorm's running statistics) and the random number
generators are as they were after the forward.

Notation: M the input rows of a call (prod of leading dims), K in_features.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def check_linear_input(fqn: str, linear: nn.Linear, x) -> None:
    """One-line ValueError when the calibration batch gives Linear ``fqn`` something other than a tensor
    (..., K): the batch does not fit the model (before this, the hook's reshape failed inside the forward)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != linear.in_features:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise ValueError(f"calibration_batch: Linear {fqn!r} got {got}, expected a tensor (..., "
                         f"{linear.in_features}): is it an input model(batch) takes?")


@torch.no_grad()
def _forward_with_pre_hooks(model: nn.Module, linears: dict[str, nn.Linear], batch,
                            on_input: Callable[[str, nn.Linear, torch.Tensor], None]) -> None:
    """One forward of ``model(batch)`` calling ``on_input(fqn, linear, x)`` before every call of each Linear; the
    buffers and RNG states are restored after it."""
    def hook_for(fqn: str):
        def hook(mod, args) -> None:  # returns None: a pre-hook's return value would replace the input
            check_linear_input(fqn, mod, args[0] if args else None)
            on_input(fqn, mod, args[0])
        return hook

    handles = [m.register_forward_pre_hook(hook_for(fqn)) for fqn, m in linears.items()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]  # e.g. BatchNorm's running statistics
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):  # e.g. Dropout's draws
            model(batch)
    finally:
        for h in handles:
            h.remove()
        for b, saved in buffers:
            b.copy_(saved)


def capture_linear_inputs(model: nn.Module, linears: dict[str, nn.Linear], batch) -> dict[str, torch.Tensor]:
    """FQN -> that Linear's real input (its first call) as (M, K)."""
    captured: dict[str, torch.Tensor] = {}
    _forward_with_pre_hooks(model, linears, batch, lambda fqn, mod, x: captured.setdefault(
        fqn, x.detach().reshape(-1, mod.in_features).clone()))
    return captured


def linear_input_rows(model: nn.Module, linears: dict[str, nn.Linear], batch) -> dict[str, set[int]]:
    """FQN -> the row counts M of every call of that Linear (one Linear may run on several inputs, e.g. tokens
    and learned seeds)."""
    rows: dict[str, set[int]] = {}
    _forward_with_pre_hooks(model, linears, batch, lambda fqn, mod, x: rows.setdefault(fqn, set()).add(
        x.numel() // mod.in_features))
    return rows
