"""The project's own Triton FP8 GEMM as a Dispatch candidate (CUDA + triton only).

- ``triton_block1x128``: activations and gradients with 1×128 scales (per row, per 128-wide group of the
  contraction dim), weights with 128×128 tile scales (DeepSeek-V3 style); e4m3 everywhere. The scales
  live in the kernel's K loop, so outliers in one group do not crush the resolution of the rest of the row.

Quantization: one Triton kernel per operand (``triton_gemm.quantize_1x128`` / ``quantize_128x128``, the
numerics of ``quant.quantize_block1x128`` / ``quantize_block128x128``); the GEMM is ``triton_gemm.blockwise_mm_nt``.
"""
from __future__ import annotations

import torch

from loka_trainer.kernels.backend_base import (GemmBackend, GemmScaling, OperandScaling, QuantOperand,
                                              cuda_capability_at_least)
from loka_trainer.kernels.triton_env import triton_importable

_ROWS_1X128 = OperandScaling("block1x128", torch.float8_e4m3fn)
_TILES_128X128 = OperandScaling("block128x128", torch.float8_e4m3fn)


class TritonBlockwise(GemmBackend):
    name = "triton_block1x128"
    min_multiple = 128

    def is_available(self, device: torch.device | str) -> bool:
        return cuda_capability_at_least(device, 8, 9) and triton_importable()

    def quantize_a(self, a: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        from loka_trainer.kernels.triton_gemm import quantize_1x128
        return quantize_1x128(a)

    def quantize_b(self, b: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        # NOTE: gradients as the b operand (weight_grad: xᵀ is b, dyᵀ is a) keep 1x128 scales; only
        # weights get 128x128 tiles, which is what lets a weight be cast once per step for both layouts.
        from loka_trainer.kernels.triton_gemm import quantize_128x128, quantize_1x128
        # one fused kernel either way (reads transposed views with their strides)
        return quantize_1x128(b) if is_grad else quantize_128x128(b)

    def operand_scaling(self, gemm: str) -> GemmScaling:
        """(a, b): 1×128 groups for activations and gradients, 128×128 tiles for the weight (forward: W,
        input_grad: Wᵀ); weight_grad's operands dyᵀ, xᵀ are both 1×128."""
        return (_ROWS_1X128, _ROWS_1X128) if gemm == "weight_grad" else (_ROWS_1X128, _TILES_128X128)

    def weight_grad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dy (M, N), x (M, K) -> dW (N, K) bf16 (both operands 1x128 along M)."""
        return self.mm_nt(dy.t(), x.t(), a_is_grad=True, b_is_grad=True)

    def _mm_nt_q(self, a: QuantOperand, b: QuantOperand) -> torch.Tensor:
        from loka_trainer.kernels.triton_gemm import blockwise_mm_nt
        return blockwise_mm_nt(a[0], a[1], b[0], b[1])


def triton_backends() -> dict[str, GemmBackend]:
    """The project's Triton GEMM backends, keyed by name (constructed without importing triton)."""
    return {b.name: b for b in [TritonBlockwise()]}
