"""The forward kernels a fused Linear -> BlockNorm -> HardSwish layer can run (``FusedLinearMods.mode``).

A registry with no kernel imports, so plan files can be read and counted without triton or CUDA.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ForwardMode:
    """``fp8``: x and W rowwise e4m3 (x by ``quant_rowwise``, W from the WeightCache), else bf16.
    ``split``: a cuBLAS GEMM (bf16 or ``torch._scaled_mm``) + the Triton epilogue kernel, else one fused
    Triton GEMM+epilogue kernel (better when N / B programs are too few to fill the GPU, see docs)."""

    fp8: bool
    split: bool


FORWARD_MODES: dict[str, ForwardMode] = {
    "fused_bf16": ForwardMode(fp8=False, split=False),
    "split_bf16": ForwardMode(fp8=False, split=True),
    "fused_fp8": ForwardMode(fp8=True, split=False),
    "split_fp8": ForwardMode(fp8=True, split=True),
}
