"""Dispatch's timing of a fused Mods layer: its forward modes, and its whole step with each input-grad backend.

Notation: M rows, K in-features, N out-features. Times are µs from the ``timer`` given (``loka_trainer.timing``).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from loka_trainer.kernels.linear import WeightCache
from loka_trainer.mods.ops import linear_mods_fp8_out


def _random_layer(M: int, K: int, N: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), w (N, K) random bf16 leaves on ``device`` that require grad."""
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    return x, (torch.randn(N, K, device=device) / K ** 0.5).to(torch.bfloat16).requires_grad_()


def _time_each(names: list[str], run, timer, what: str, shape: tuple[int, int, int], compiled: bool = False
               ) -> dict[str, Optional[float]]:
    """name -> timer(lambda: run(name)) µs (``run`` under ``torch.compile`` when ``compiled``); a name whose run
    raises RuntimeError -> None (with a warning): a kernel that fails at this shape is not a candidate, never an
    error."""
    times: dict[str, Optional[float]] = {}
    for name in names:
        call = torch.compile(lambda name=name: run(name)) if compiled else (lambda name=name: run(name))
        try:
            times[name] = timer(call)
        except RuntimeError as exc:
            warnings.warn(f"{what} {name} failed at M×K×N={'×'.join(map(str, shape))}: "
                          f"{str(exc).splitlines()[0][:200]}")
            times[name] = None
    return times


def time_forward_modes(M: int, K: int, N: int, modes: list[str], *, block: int, eps: float, timer,
                       device, compiled: bool = False) -> dict[str, Optional[float]]:
    """µs of one training forward (autograd on, weight cast cached as in training) of each forward mode at
    x (M, K), w (N, K) random bf16 on ``device``; a mode that raises there -> None (with a warning)."""
    x, w = _random_layer(M, K, N, device)
    cache = WeightCache()
    run = lambda mode: linear_mods_fp8_out(x, w, block=block, eps=eps, mode=mode, cache=cache)  # noqa: E731
    return _time_each(modes, run, timer, "mods forward mode", (M, K, N), compiled)


def time_input_grads(M: int, K: int, N: int, dgrads: list[str], *, mode: str, wgrad: str, block: int, eps: float,
                     timer, device, compiled: bool = False) -> dict[str, Optional[float]]:
    """µs of one training step of the layer (forward in ``mode`` + backward with ``wgrad``; gradients written
    fresh, as after ``zero_grad(set_to_none=True)``) with each input-grad backend in ``dgrads``, at random bf16
    x (M, K), w (N, K) and dy (M, N) on ``device``; one that raises there -> None (with a warning)."""
    x, w = _random_layer(M, K, N, device)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    cache = WeightCache()

    def step(dgrad: str) -> None:
        x.grad = w.grad = None
        linear_mods_fp8_out(x, w, block=block, eps=eps, mode=mode, dgrad=dgrad, wgrad=wgrad,
                            cache=cache)[0].backward(dy)
    return _time_each(dgrads, step, timer, "mods input grad", (M, K, N), compiled)
