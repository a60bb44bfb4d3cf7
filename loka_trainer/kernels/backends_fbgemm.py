"""FP8 backends on FBGEMM genai ops (CUDA only; optional — unavailable when fbgemm_gpu genai does not load).

Recipes (a · bᵀ, a (R, C), b (P, C); each op quantizes its operands along the contraction dim C):

- ``fbgemm_rowwise``:    ``quantize_fp8_per_row`` + ``f8f8bf16_rowwise`` (scale per row of a and b)
- ``fbgemm_tensorwise``: ``quantize_fp8_per_tensor`` + ``f8f8bf16`` (one scale per operand)
- ``fbgemm_blockwise``:  FBGEMM's Triton ``quantize_fp8_block`` + ``matmul_fp8_block`` (128×128 tiles)

All operands are e4m3 (the FBGEMM kernels take e4m3 only), gradients included.
"""
from __future__ import annotations

import functools

import torch

from loka_trainer.kernels.backend_base import GemmBackend, QuantOperand, cuda_capability_at_least


@functools.lru_cache(maxsize=1)
def fbgemm_genai_loaded() -> bool:
    """True if ``fbgemm_gpu.experimental.gen_ai`` imports and registers its FP8 ops."""
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm.*)
    except Exception:  # any failure (missing, CPU-only build, ABI mismatch) means "not a candidate"
        return False
    return hasattr(torch.ops.fbgemm, "f8f8bf16_rowwise")


class _FbgemmBackend(GemmBackend):
    min_multiple = 16

    def is_available(self, device: torch.device | str) -> bool:
        return cuda_capability_at_least(device, 9, 0) and fbgemm_genai_loaded()


class FbgemmRowwise(_FbgemmBackend):
    name = "fbgemm_rowwise"
    granularity = "rowwise"

    def quantize_a(self, a: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        q, scale_inv = torch.ops.fbgemm.quantize_fp8_per_row(a.contiguous().to(torch.bfloat16))
        return q, scale_inv  # q (R, C) e4m3, scale_inv (R,)

    def _mm_nt_q(self, a: QuantOperand, b: QuantOperand) -> torch.Tensor:
        return torch.ops.fbgemm.f8f8bf16_rowwise(a[0], b[0], a[1], b[1])


class FbgemmTensorwise(_FbgemmBackend):
    name = "fbgemm_tensorwise"
    granularity = "tensorwise"

    def quantize_a(self, a: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        q, scale_inv = torch.ops.fbgemm.quantize_fp8_per_tensor(a.contiguous().to(torch.bfloat16))
        return q, scale_inv  # scale_inv: one element

    def _mm_nt_q(self, a: QuantOperand, b: QuantOperand) -> torch.Tensor:
        return torch.ops.fbgemm.f8f8bf16(a[0], b[0], (a[1] * b[1]).reshape(()))


class FbgemmBlockwise(_FbgemmBackend):
    name = "fbgemm_blockwise"
    granularity = "block128x128"
    min_multiple = 128  # whole 128×128 tiles keep the kernel on its fast path

    def quantize_a(self, a: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        from fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm import quantize_fp8_block
        q, scale_inv = quantize_fp8_block(a.contiguous().to(torch.bfloat16), 128, 128)
        return q, scale_inv  # scale_inv (ceil(R/128), ceil(C/128))

    def _mm_nt_q(self, a: QuantOperand, b: QuantOperand) -> torch.Tensor:
        from fbgemm_gpu.experimental.gemm.triton_gemm.fp8_gemm import matmul_fp8_block
        return matmul_fp8_block(a[0], b[0], a[1], b[1], 128, 128, 128)


def fbgemm_backends() -> dict[str, GemmBackend]:
    """The FBGEMM genai recipes, keyed by name (constructed without importing fbgemm)."""
    backends = [FbgemmRowwise(), FbgemmTensorwise(), FbgemmBlockwise()]
    return {b.name: b for b in backends}
