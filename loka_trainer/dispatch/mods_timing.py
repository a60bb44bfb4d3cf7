"""Dispatch's timing of a fused Mods layer: its whole training step in each forward mode, then with each input-grad
backend.

What is timed is the ``FusedLinearMods`` module the model will run with those kernels, compiled when the model
will be; mode ``plain`` is the plain PyTorch math (``mods.module.plain_math_route``), so compiled it is the plain
Mods as inductor fuses them, and any other choice has to beat exactly that. Each timed call is one training step of
a new weight version: the layer's FP8 weight cache is cleared first, so the weight casts every step pays are counted
(a captured call that hit the cache would leave them out of an eager candidate's time while the compiled one, which
casts inside its graph, paid them). Notation: M rows, K in-features, N out-features. Times are µs from the
``timer`` given (``loka_trainer.timing``).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from loka_trainer.dispatch.measure import DEFAULT_OUTLIER_FACTOR, DEFAULT_ROUNDS, time_rounds
from loka_trainer.mods.module import FusedLinearMods


def _random_step_operands(M: int, K: int, N: int, device) -> tuple[torch.Tensor, nn.Parameter, torch.Tensor]:
    """x (M, K) a random bf16 leaf that requires grad, w (N, K) a random bf16 Parameter, dy (M, N) random bf16, on
    ``device``, drawn from a generator of their own: converting a model must not move the user's random stream
    (a run that measures its plan and one that loads it would then draw different dropout masks)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
    w = nn.Parameter((torch.randn(N, K, device=device, generator=gen) / K ** 0.5).to(torch.bfloat16))
    return x, w, torch.randn(M, N, device=device, generator=gen).to(torch.bfloat16)


def _layer(w: nn.Parameter, *, block: int, eps: float, mode: str, dgrad: str = "bf16",
           wgrad: str = "bf16") -> FusedLinearMods:
    """The fused layer with these kernels, its weight the shared ``w`` (N, K)."""
    layer = FusedLinearMods(w.shape[1], w.shape[0], block_size=block, eps=eps, mode=mode, dgrad=dgrad, wgrad=wgrad,
                            device="meta")
    layer.weight = w
    return layer


def _time_each(layers: dict[str, FusedLinearMods], run, timer, what: str, shape: tuple[int, int, int],
               compiled: bool = False, rounds: int = DEFAULT_ROUNDS, outlier_factor: float = DEFAULT_OUTLIER_FACTOR
               ) -> dict[str, Optional[list[float]]]:
    """name -> µs of ``run(layers[name])`` in each of ``rounds`` interleaved rounds (``measure.time_rounds``;
    under ``torch.compile`` when ``compiled``), the layer's weight cache cleared before each call (module
    docstring); a name whose run raises RuntimeError -> None (with a warning): a kernel that fails at this shape
    is not a candidate, never an error."""
    def call(layer: FusedLinearMods):
        body = torch.compile(lambda: run(layer)) if compiled else (lambda: run(layer))

        def step():
            layer.clear_weight_cache()
            return body()
        return step
    calls = {name: call(layer) for name, layer in layers.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        times = time_rounds(calls, timer, rounds=rounds, outlier_factor=outlier_factor)
    for w in caught:
        warnings.warn(f"{what} at M×K×N={'×'.join(map(str, shape))}: {w.message}")
    return times


def time_modes(M: int, K: int, N: int, modes: list[str], *, wgrad: str, block: int, eps: float, timer,
               device, compiled: bool = False, rounds: int = DEFAULT_ROUNDS,
               outlier_factor: float = DEFAULT_OUTLIER_FACTOR) -> dict[str, Optional[list[float]]]:
    """µs per timing round of one training step (forward + backward, BF16 input grad, ``wgrad`` weight grad) of
    the layer in each forward mode at random bf16 x (M, K), w (N, K), dy (M, N) on ``device``; a mode that raises
    there -> None (warned). The step, not the forward alone: each mode brings its own backward (``plain``:
    autograd's, fused by inductor when compiled; a kernel mode: the fused dz kernel), and a mode's forward may be
    faster while its step is slower."""
    return _time_steps(M, K, N, {mode: {"mode": mode, "dgrad": "bf16", "wgrad": wgrad} for mode in modes},
                       block=block, eps=eps, timer=timer, device=device, what="mods forward mode",
                       compiled=compiled, rounds=rounds, outlier_factor=outlier_factor)


def time_input_grads(M: int, K: int, N: int, dgrads: list[str], *, mode: str, wgrad: str, block: int, eps: float,
                     timer, device, compiled: bool = False, rounds: int = DEFAULT_ROUNDS,
                     outlier_factor: float = DEFAULT_OUTLIER_FACTOR) -> dict[str, Optional[list[float]]]:
    """µs per timing round of one training step of the layer (forward in ``mode`` + backward with ``wgrad``;
    gradients written fresh, as after ``zero_grad(set_to_none=True)``) with each input-grad backend in
    ``dgrads``, at random bf16 x (M, K), w (N, K) and dy (M, N) on ``device``; one that raises there -> None
    (with a warning)."""
    return _time_steps(M, K, N, {dgrad: {"mode": mode, "dgrad": dgrad, "wgrad": wgrad} for dgrad in dgrads},
                       block=block, eps=eps, timer=timer, device=device, what="mods input grad",
                       compiled=compiled, rounds=rounds, outlier_factor=outlier_factor)


def _time_steps(M: int, K: int, N: int, kernels: dict[str, dict[str, str]], *, block: int, eps: float, timer,
                device, what: str, compiled: bool, rounds: int, outlier_factor: float
                ) -> dict[str, Optional[list[float]]]:
    """name -> µs per round of one training step of the layer with ``kernels[name]`` (mode, dgrad, wgrad), all
    sharing one random bf16 x (M, K), w (N, K), dy (M, N); gradients written fresh, as after
    ``zero_grad(set_to_none=True)``."""
    x, w, dy = _random_step_operands(M, K, N, device)
    layers = {name: _layer(w, block=block, eps=eps, **k) for name, k in kernels.items()}

    def step(layer: FusedLinearMods) -> None:
        x.grad = w.grad = None
        layer(x).backward(dy)
    return _time_each(layers, step, timer, what, (M, K, N), compiled, rounds, outlier_factor)
