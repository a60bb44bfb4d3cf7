"""The forward kernels a fused Linear -> BlockNorm -> HardSwish layer can run (``FusedLinearMods.mode``).

A registry with no kernel imports, so plan files can be read and counted without triton or CUDA.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ForwardMode:
    """``fp8``: x and W rowwise e4m3 (x by ``quant_rowwise``, W from the WeightCache), else bf16.
    ``split``: a cuBLAS GEMM (bf16 or ``torch._scaled_mm``) + the Triton epilogue kernel, else one fused
    Triton GEMM+epilogue kernel (better when N / B programs are too few to fill the GPU, see docs).
    ``triton``: False for ``plain``, the unfused PyTorch math (``F.linear``, ``block_rms_norm``, ``F.hardswish``;
    BF16 GEMMs only), which inductor fuses when compiled; ``split`` means nothing there."""

    fp8: bool
    split: bool
    triton: bool = True

    def takes_backward(self, dgrad: str, wgrad: str) -> bool:
        """Whether this mode runs with these input- and weight-grad backends: ``plain`` only with ``bf16`` ones
        (autograd's GEMMs); a kernel mode with any."""
        return self.triton or dgrad == wgrad == "bf16"


PLAIN_MODE = "plain"

FORWARD_MODES: dict[str, ForwardMode] = {
    PLAIN_MODE: ForwardMode(fp8=False, split=False, triton=False),
    "fused_bf16": ForwardMode(fp8=False, split=False),
    "split_bf16": ForwardMode(fp8=False, split=True),
    "fused_fp8": ForwardMode(fp8=True, split=False),
    "split_fp8": ForwardMode(fp8=True, split=True),
}

# Without a Dispatch plan (or a plan built off-GPU): cuBLAS + the epilogue kernel. On the H200 it was faster than
# the single fused kernel at 8 of 9 figure-13 shapes and within 1.5% at the ninth (CHANGELOG.md, 2026-11-30; in
# the current layer table, docs/kernels/README.md, a split mode is the fastest at eight shapes).
DEFAULT_FORWARD_MODE = "split_bf16"


def default_forward_mode(*, compiled: bool, dgrad: str = "bf16", wgrad: str = "bf16") -> str:
    """The forward mode of a fused BF16-forward layer with no measured choice: ``plain`` when the model will be
    compiled and ``plain`` takes the layer's backward backends (inductor fuses BlockNorm + HardSwish into the plain
    math; timed compiled on the H200, Dispatch kept it at 6 of the 9 figure-13 shapes, docs/results.md §3), else
    ``DEFAULT_FORWARD_MODE``. Dispatch, compiled, times ``plain`` against the Triton modes per layer."""
    if compiled and FORWARD_MODES[PLAIN_MODE].takes_backward(dgrad, wgrad):
        return PLAIN_MODE
    return DEFAULT_FORWARD_MODE
