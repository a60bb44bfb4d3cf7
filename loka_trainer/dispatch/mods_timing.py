"""Dispatch's timing of a fused Mods layer: its forward modes, and its whole step with each input-grad backend.

Notation: M rows, K in-features, N out-features. Times are µs from the ``timer`` given (``loka_trainer.timing``).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from loka_trainer.dispatch.measure import DEFAULT_OUTLIER_FACTOR, DEFAULT_ROUNDS, time_rounds
from loka_trainer.kernels.linear import WeightCache
from loka_trainer.mods.ops import linear_mods_fp8_out


def _random_layer(M: int, K: int, N: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), w (N, K) random bf16 leaves on ``device`` that require grad."""
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    return x, (torch.randn(N, K, device=device) / K ** 0.5).to(torch.bfloat16).requires_grad_()


def _time_each(names: list[str], run, timer, what: str, shape: tuple[int, int, int], compiled: bool = False,
               rounds: int = DEFAULT_ROUNDS, outlier_factor: float = DEFAULT_OUTLIER_FACTOR
               ) -> dict[str, Optional[list[float]]]:
    """name -> µs of ``run(name)`` in each of ``rounds`` interleaved rounds (``measure.time_rounds``; under
    ``torch.compile`` when ``compiled``); a name whose run raises RuntimeError -> None (with a warning): a
    kernel that fails at this shape is not a candidate, never an error."""
    calls = {name: torch.compile(lambda name=name: run(name)) if compiled else (lambda name=name: run(name))
             for name in names}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        times = time_rounds(calls, timer, rounds=rounds, outlier_factor=outlier_factor)
    for w in caught:
        warnings.warn(f"{what} at M×K×N={'×'.join(map(str, shape))}: {w.message}")
    return times


def time_forward_modes(M: int, K: int, N: int, modes: list[str], *, block: int, eps: float, timer,
                       device, compiled: bool = False, rounds: int = DEFAULT_ROUNDS,
                       outlier_factor: float = DEFAULT_OUTLIER_FACTOR) -> dict[str, Optional[list[float]]]:
    """µs per timing round of one training forward (autograd on, weight cast cached as in training) of each
    forward mode at x (M, K), w (N, K) random bf16 on ``device``; a mode that raises there -> None (warned)."""
    x, w = _random_layer(M, K, N, device)
    cache = WeightCache()
    run = lambda mode: linear_mods_fp8_out(x, w, block=block, eps=eps, mode=mode, cache=cache)  # noqa: E731
    return _time_each(modes, run, timer, "mods forward mode", (M, K, N), compiled, rounds,
                      outlier_factor)


def time_input_grads(M: int, K: int, N: int, dgrads: list[str], *, mode: str, wgrad: str, block: int, eps: float,
                     timer, device, compiled: bool = False, rounds: int = DEFAULT_ROUNDS,
                     outlier_factor: float = DEFAULT_OUTLIER_FACTOR) -> dict[str, Optional[list[float]]]:
    """µs per timing round of one training step of the layer (forward in ``mode`` + backward with ``wgrad``;
    gradients written fresh, as after ``zero_grad(set_to_none=True)``) with each input-grad backend in
    ``dgrads``, at random bf16 x (M, K), w (N, K) and dy (M, N) on ``device``; one that raises there -> None
    (with a warning)."""
    x, w = _random_layer(M, K, N, device)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    cache = WeightCache()

    def step(dgrad: str) -> None:
        x.grad = w.grad = None
        linear_mods_fp8_out(x, w, block=block, eps=eps, mode=mode, dgrad=dgrad, wgrad=wgrad,
                            cache=cache)[0].backward(dy)
    return _time_each(dgrads, step, timer, "mods input grad", (M, K, N), compiled, rounds,
                      outlier_factor)
