"""ModsKernelConfig: how a fused Mods layer runs its kernels, beyond the forward mode and the two backward
backends (which Dispatch chooses per layer): a frozen value each ``FusedLinearMods`` carries and passes down to its
op, as torchao's ``Float8LinearConfig`` does for ``Float8Linear``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModsKernelConfig:
    """``backward_streams``: the backward's dx = dz·W and dW = dzᵀ·x on two CUDA streams (``streams.side_by_side``),
    else in order on one. Two streams were faster for the BF16 and rowwise-FP8-dgrad layers at the small
    figure-13 shapes (up to 3.9 µs a step on the H200), in order faster for a tensorwise FP8 dgrad at 6 of 9
    shapes (up to 2.5 µs; docs/kernels/README.md "Backward", two_streams_2026-11-30.json): a per-layer choice."""

    backward_streams: bool = True


DEFAULT_KERNEL_CONFIG = ModsKernelConfig()
