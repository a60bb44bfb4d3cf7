"""FusedLinearMods: HardSwish(BlockNorm(x·Wᵀ)) as one module, the layer ``mods.transform`` puts in place of a
Linear -> BlockNorm -> HardSwish triple.

Notation: M = prod(leading dims of x), K in_features, N out_features, B the BlockNorm block.

On a device without Triton (CPU) the module runs the unfused math in x's dtype: exact for an all-BF16 layer, and a
layer with FP8 GEMMs runs them as ``LoKALinear`` does (FP8 numerics on the CPU too; its FP8 forward is rowwise
e4m3, ``FP8_WEIGHT_BACKEND``, as the fused kernel's). On CUDA it runs ``mods.ops.LinearModsFn`` (fused forward,
fused dz backward), eager or compiled (our ops are ``triton_op``s: inductor launches their kernels from its own
code) — except in mode ``plain`` (``plain_math_route``), the unfused PyTorch math, which inductor fuses when
compiled: the default of a compiled BF16 layer without a measured choice (``mods.modes.default_forward_mode``), and
Dispatch's plain-Mods candidate.
The FP8 handoff between two fused layers (``emit_fp8``, ``_fp8_source``) is linked by
``mods.transform.chain_fp8_handoffs``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loka_trainer.kernels.backends import BASELINE, get_backend
from loka_trainer.kernels.linear import WeightCache, linear_on_backends
from loka_trainer.kernels.triton_env import interpreting
from loka_trainer.module_hooks import FORWARD_PRE_HOOKS, carry_hooks
from loka_trainer.mods.config import DEFAULT_KERNEL_CONFIG, ModsKernelConfig
from loka_trainer.mods.layers import BlockNorm, block_rms_norm
from loka_trainer.mods.modes import DEFAULT_FORWARD_MODE, FORWARD_MODES
from loka_trainer.mods.ops import FP8_WEIGHT_BACKEND, linear_mods_fp8_out, static_scale_inv


def plain_math_route(*, on_cuda: bool, compiling: bool, interpreting: bool, mode: str) -> bool:
    """True when a FusedLinearMods call should run the unfused PyTorch math instead of the Triton path: mode
    ``plain``, or no Triton device (CPU outside the interpreter)."""
    return not FORWARD_MODES[mode].triton or not (on_cuda or (not compiling and interpreting))


class FusedLinearMods(nn.Module):
    """HardSwish(BlockNorm(x·Wᵀ)) as one module: x (..., K) -> (..., N). Parameter ``weight`` (N, K), no bias.

    ``mode`` is the forward kernel (``mods.modes.FORWARD_MODES``); ``dgrad`` / ``wgrad`` the backends of
    dx = dz·W and dW = dzᵀ·x (``bf16`` = cuBLAS; a ``torch._scaled_mm`` dgrad runs fused,
    ``mods.ops_fp8.FUSED_DGRAD``; mode ``plain`` takes only ``bf16``); ``config`` the ``ModsKernelConfig`` it
    passes to its op (a frozen value: assign a new one to change it).
    """

    def __init__(self, in_features: int, out_features: int, *, block_size: int = 256, eps: float = 1e-6,
                 mode: str = DEFAULT_FORWARD_MODE, dgrad: str = "bf16", wgrad: str = "bf16",
                 config: ModsKernelConfig = DEFAULT_KERNEL_CONFIG, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Linear's init
        self.block_size, self.eps = block_size, eps
        self.set_kernels(mode=mode, dgrad=dgrad, wgrad=wgrad)
        self.config = config
        self._weight_cache = WeightCache(reuse=False)
        self._init_handoff()

    def set_kernels(self, *, mode: str, dgrad: str, wgrad: str) -> None:
        """Choose the forward mode and the two backward backends; unknown names, or an FP8 backend with mode
        ``plain`` (autograd's BF16 GEMMs) -> ValueError."""
        if mode not in FORWARD_MODES:
            raise ValueError(f"FusedLinearMods mode: unknown {mode!r}; valid: {sorted(FORWARD_MODES)}")
        get_backend(dgrad), get_backend(wgrad)
        if not FORWARD_MODES[mode].takes_backward(dgrad, wgrad):
            raise ValueError(f"FusedLinearMods mode {mode!r} runs its backward GEMMs in {BASELINE}: got "
                             f"dgrad={dgrad!r}, wgrad={wgrad!r}")
        self.mode, self.dgrad, self.wgrad = mode, dgrad, wgrad

    @classmethod
    def from_linear(cls, linear: nn.Module, norm: BlockNorm, *, config: ModsKernelConfig = DEFAULT_KERNEL_CONFIG,
                    **kernels: str) -> "FusedLinearMods":
        """Replacement sharing ``linear.weight`` (the Parameter object itself) and the hooks on ``linear``'s input
        (``module_hooks.FORWARD_PRE_HOOKS``: the fused layer takes the same input; ``mods.transform`` does not
        fuse a triple with any other hook)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.block_size, new.eps = norm.block_size, norm.eps
        new.set_kernels(**{"mode": DEFAULT_FORWARD_MODE, "dgrad": "bf16", "wgrad": "bf16", **kernels})
        new.config = config
        new._weight_cache = WeightCache(reuse=False)
        new._init_handoff()
        carry_hooks(linear, new, FORWARD_PRE_HOOKS)
        return new

    def clear_weight_cache(self) -> None:
        """Forget the cast FP8 weight operands (the weight changed; the optimizer hook calls the cache's clear)."""
        self._weight_cache.clear()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._weight_cache.clear()  # new weight values, possibly written without a version bump
        super()._load_from_state_dict(*args, **kwargs)

    def _init_handoff(self) -> None:
        self.emit_fp8 = False  # write the output in FP8 too, for the next FusedLinearMods
        # the FusedLinearMods whose FP8 output this one reads (plain attribute: not a submodule, not in state_dict)
        object.__setattr__(self, "_fp8_source", None)
        self._handoff: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (output as returned, its e4m3 copy)

    def _take_fp8_input(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
        """(x in e4m3 (M, K), scale_inv) if the source layer's last output is exactly ``x``, else None."""
        src = self._fp8_source
        if src is None or src._handoff is None or src._handoff[0] is not x:
            return None
        q = src._handoff[1]
        src._handoff = None  # hand over once; free it with the activation's other consumers
        return q, static_scale_inv(src.block_size)

    def _unfused_linear(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 (M, K) -> z = x2·Wᵀ (M, N) in x2's dtype: ``F.linear`` for an all-BF16 layer, else each GEMM on the
        layer's backend (the FP8 forward modes' rowwise e4m3 is ``FP8_WEIGHT_BACKEND``)."""
        forward = FP8_WEIGHT_BACKEND if FORWARD_MODES[self.mode].fp8 else BASELINE
        if forward == self.dgrad == self.wgrad == BASELINE:
            return F.linear(x2, self.weight.to(x2.dtype))
        return linear_on_backends(x2, self.weight, None, forward=forward, input_grad=self.dgrad,
                                  weight_grad=self.wgrad, cache=self._weight_cache)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N)."""
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        compiling = torch.compiler.is_compiling()
        # NOTE: interpreting() only outside compiled code: torch.compile never traces its environment lookup.
        if plain_math_route(on_cuda=x2.is_cuda, compiling=compiling, interpreting=not compiling and interpreting(),
                            mode=self.mode):
            # the unfused math in x's dtype (inductor fuses it when compiled)
            y = F.hardswish(block_rms_norm(self._unfused_linear(x2), self.block_size, self.eps))
        else:
            eager = not compiling
            x_fp8 = self._take_fp8_input(x) if eager else None
            y, q = linear_mods_fp8_out(x2, self.weight, block=self.block_size, eps=self.eps, mode=self.mode,
                                       dgrad=self.dgrad, wgrad=self.wgrad, cache=self._weight_cache,
                                       x_fp8=None if x_fp8 is None else x_fp8[0],
                                       x_fp8_scale_inv=1.0 if x_fp8 is None else x_fp8[1],
                                       emit_fp8=self.emit_fp8 and eager, config=self.config)
            out = y.reshape(*x.shape[:-1], self.out_features)
            if eager:
                self._handoff = None if q is None else (out, q)
            return out
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, block_size={self.block_size}, mode={self.mode}, "
                f"dgrad={self.dgrad}, wgrad={self.wgrad}" + (", emit_fp8=True" if self.emit_fp8 else "")
                + ("" if self.config == DEFAULT_KERNEL_CONFIG else f", config={self.config}"))
