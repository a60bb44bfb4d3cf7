"""The GEMM backend interface every Dispatch candidate implements, and the BF16 baseline.

Notation: M batch rows, K in-features, N out-features. A Linear runs three GEMMs:

- forward      y  = x · Wᵀ     x (M, K), W (N, K)  -> y  (M, N)
- input_grad   dx = dy · W     dy (M, N), W (N, K) -> dx (M, K)
- weight_grad  dW = dyᵀ · x    dy (M, N), x (M, K) -> dW (N, K)

All three are one "NT" GEMM ``mm_nt(a (R, C), b (P, C)) -> (R, P)`` contracting the last dim of two row-major
operands: forward (x, W), input_grad (dy, Wᵀ), weight_grad (dyᵀ, xᵀ). A backend that scales "per row"
therefore always scales along the contraction dim, which is what rowwise FP8 GEMMs need.

Each backend declares how it casts each GEMM's two NT operands (``operand_scaling``: a ``quant.QUANTIZERS``
granularity and an FP8 dtype per operand), so Dispatch can measure what that cast loses on the layer's real
operands (``probe.flush``) without running the backend's own quantizer.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

GEMMS = ("forward", "input_grad", "weight_grad")  # the three GEMMs of a Linear, in the order they run

# NOTE: a pre-quantized operand is (q, scale_inv) as returned by ``quant.quantize``; for BF16 it is (w_bf16, None).
QuantOperand = tuple[torch.Tensor, Optional[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class OperandScaling:
    """How one NT operand (R, C) of a GEMM is cast to FP8: ``granularity`` a ``quant.QUANTIZERS`` name taken in
    that layout (``rowwise``: one scale per row, i.e. along the contraction dim C), ``dtype`` the FP8 dtype,
    ``power_of_2_scales`` whether each scale is rounded down to a power of 2 (torchao's rowwise recipes)."""

    granularity: str
    dtype: torch.dtype
    power_of_2_scales: bool = False


# The (a, b) operands' scaling of one GEMM; None for an operand kept in high precision (or not declared).
GemmScaling = tuple[Optional[OperandScaling], Optional[OperandScaling]]


class GemmBackend:
    """One way to run the three GEMMs of a Linear. Subclasses override ``quantize_b`` and ``_mm_nt_q``.

    Each public method takes high-precision tensors and does its own quantization (so MERE and timings
    include it) and returns bf16. ``b_q`` lets a caller pass a weight operand quantized once per optimizer
    step (see ``LoKALinear``) instead of once per GEMM.
    """

    name: str = "abstract"
    min_multiple: int = 1  # every dim of every operand must be a multiple of this
    # The GEMMs this backend runs in FP8; the others it runs in high precision (bitwise the BF16 baseline's
    # result), so they count, print and are chosen as BF16 (``is_fp8``).
    fp8_gemms: frozenset[str] = frozenset(GEMMS)
    # The ``quant.QUANTIZERS`` granularity of every operand, and the FP8 dtype of the gradient operands (dy, dyᵀ;
    # activations and weights are e4m3): what ``operand_scaling`` reports unless a subclass says otherwise.
    # None: not declared (``operand_scaling`` then reports nothing).
    granularity: Optional[str] = None
    grad_dtype: torch.dtype = torch.float8_e4m3fn

    def is_fp8(self, gemm: str) -> bool:
        """True if this backend runs ``gemm`` (one of ``GEMMS``) in FP8."""
        return gemm in self.fp8_gemms

    def operand_scaling(self, gemm: str) -> GemmScaling:
        """How ``gemm``'s NT operands (a, b) are cast to FP8 (module docstring: forward (x, W), input_grad
        (dy, Wᵀ), weight_grad (dyᵀ, xᵀ)); (None, None) for a GEMM run in high precision or without a declared
        ``granularity``."""
        if self.granularity is None or not self.is_fp8(gemm):
            return None, None
        act = OperandScaling(self.granularity, torch.float8_e4m3fn)
        return (act, act) if gemm == "forward" else (OperandScaling(self.granularity, self.grad_dtype), act)

    def is_available(self, device: torch.device | str) -> bool:
        """True if this backend can run on ``device`` (libraries importable, hardware capable)."""
        raise NotImplementedError

    def supports(self, M: int, K: int, N: int) -> bool:
        """True if all three GEMMs of a Linear of this shape can run on this backend."""
        m = self.min_multiple
        return all(d > 0 and d % m == 0 for d in (M, K, N))

    def quantize_a(self, a: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        """a (R, C) high precision -> the operand form ``_mm_nt_q`` consumes."""
        raise NotImplementedError

    def quantize_b(self, b: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        """b (P, C) high precision -> the operand form ``_mm_nt_q`` consumes."""
        return self.quantize_a(b, is_grad=is_grad)

    def _mm_nt_q(self, a: QuantOperand, b: QuantOperand) -> torch.Tensor:
        """Quantized a (R, C), b (P, C) -> (R, P) bf16."""
        raise NotImplementedError

    def quantize_weight_forward(self, w: torch.Tensor) -> QuantOperand:
        """w (N, K) -> the forward GEMM's weight operand, to cache once per optimizer step."""
        return self.quantize_b(w, is_grad=False)

    def quantize_weight_input_grad(self, w: torch.Tensor) -> QuantOperand:
        """w (N, K) -> the input-grad GEMM's weight operand (built from wᵀ (K, N)), to cache per step."""
        return self.quantize_b(w.t(), is_grad=False)

    def mm_nt(self, a: torch.Tensor, b: torch.Tensor, *, a_is_grad: bool, b_is_grad: bool = False,
              b_q: Optional[QuantOperand] = None) -> torch.Tensor:
        """a (R, C), b (P, C) -> a · bᵀ (R, P) bf16."""
        qa = self.quantize_a(a, is_grad=a_is_grad)
        qb = b_q if b_q is not None else self.quantize_b(b, is_grad=b_is_grad)
        return self._mm_nt_q(qa, qb)

    def forward(self, x: torch.Tensor, w: torch.Tensor, *, w_q: Optional[QuantOperand] = None) -> torch.Tensor:
        """x (M, K), w (N, K) -> y (M, N) bf16."""
        return self.mm_nt(x, w, a_is_grad=False, b_q=w_q)

    def input_grad(self, dy: torch.Tensor, w: torch.Tensor, *,
                   wt_q: Optional[QuantOperand] = None) -> torch.Tensor:
        """dy (M, N), w (N, K) -> dx (M, K) bf16. ``wt_q`` is ``quantize_b(w.t())`` if precomputed."""
        return self.mm_nt(dy, w.t(), a_is_grad=True, b_q=wt_q)

    def weight_grad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dy (M, N), x (M, K) -> dW (N, K) bf16."""
        return self.mm_nt(dy.t(), x.t(), a_is_grad=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class BF16Backend(GemmBackend):
    """The baseline: a plain BF16 GEMM (cuBLAS on GPU, fp32 accumulation)."""

    name = "bf16"
    fp8_gemms = frozenset()

    def is_available(self, device: torch.device | str) -> bool:
        return True

    def quantize_a(self, a: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        return a.to(torch.bfloat16), None

    def _mm_nt_q(self, a: QuantOperand, b: QuantOperand) -> torch.Tensor:
        return a[0] @ b[0].t()


def is_cuda(device: torch.device | str) -> bool:
    """True if ``device`` is a CUDA device and CUDA is usable in this process."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def emulates_fp8(device: torch.device | str) -> bool:
    """True where FP8 GEMMs run as fp32 matmuls of the fp8 values (the same numbers, no FP8 speed): on CPU, where
    ``torch._scaled_mm`` is oneDNN's, which on CPUs without FP8 units runs a reference loop (~5 s for one
    1024x256x512 GEMM with torch 2.13.0+cpu, against 6 ms emulated)."""
    return torch.device(device).type == "cpu"


def cuda_capability_at_least(device: torch.device | str, major: int, minor: int = 0) -> bool:
    """True on a CUDA device of compute capability >= (major, minor) (FP8 tensor cores need 8.9)."""
    if not is_cuda(device):
        return False
    return torch.cuda.get_device_capability(torch.device(device)) >= (major, minor)
