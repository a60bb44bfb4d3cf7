"""FP8 backends on ``torch._scaled_mm`` (cuBLASLt on GPU; the same math in fp32 on CPU).

Recipes (a · bᵀ with a (R, C), b (P, C), contraction over C; see backend_base for the three GEMMs):

- ``scaled_mm_tensorwise``: one scale per operand; activations and weights e4m3, gradients e5m2
  (wider range for dy; the classic FP8 training recipe).
- ``scaled_mm_rowwise``: one scale per row of each operand along the contraction dim (scale_a (R, 1),
  scale_b (1, P)); all e4m3 because cuBLASLt's rowwise kernels take e4m3 only.
- ``*_fast_accum``: the same recipe on cuBLASLt's fast-accumulation FP8 GEMMs (``use_fast_accum``: the tensor
  cores' own accumulator, never promoted to fp32 registers during the K loop) in all three GEMMs. torchao uses
  them for the forward GEMM only by default; here Dispatch decides per GEMM from MERE and timings like for any
  other backend. On the H200 at the figure-13 GEMMs (batch 1024) they were up to 1.3x faster, with outputs
  within 3e-3 (relative Frobenius) of the exact-accumulation ones (docs/kernels/README.md, "Fast accumulation";
  ``benchmarks/fast_accum_gemms.py``). On CPU the flag
  changes nothing (torch's reference accumulates in fp32 either way).
"""
from __future__ import annotations

import torch

from loka_trainer.kernels.backend_base import GemmBackend, QuantOperand, cuda_capability_at_least, emulates_fp8
from loka_trainer.kernels.quant import quantize
from loka_trainer.kernels.triton_env import use_triton
from loka_trainer.kernels.triton_quant import quant_rowwise
from loka_trainer.kernels.triton_quant_tensorwise import quant_tensorwise

# granularity -> (fused Triton quantizer (t, dtype) -> (q, scale_inv), the FP8 dtypes it writes): one or two
# kernels instead of ~7 eager ops (see triton_quant, triton_quant_tensorwise); same numerics as quant.quantize.
FUSED_QUANTIZERS = {
    "rowwise": (lambda t, dtype: quant_rowwise(t), (torch.float8_e4m3fn,)),
    "tensorwise": (quant_tensorwise, (torch.float8_e4m3fn, torch.float8_e5m2)),
}


FAST_ACCUM_SUFFIX = "_fast_accum"


def scaled_mm_nt(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
                 fast_accum: bool = False) -> torch.Tensor:
    """qa (R, C), qb (P, C) row-major fp8, sa (R, 1), sb (P, 1) fp32 (rowwise) or both () (tensorwise)
    -> (qa·sa)·(qb·sb)ᵀ (R, P) bf16: cuBLASLt's FP8 GEMM on CUDA (fp32 matmul on CPU); R, C, P % 16 == 0.
    ``fast_accum``: cuBLASLt's fast-accumulation kernels (module docstring)."""
    sb = sb if sb.dim() == 0 else sb.reshape(1, -1)  # b's row scales (P, 1) are the column scales of bᵀ
    if emulates_fp8(qa.device):  # fp8 values are exact in fp32: products accumulate in fp32, then the scales
        with torch.autocast("cpu", enabled=False):
            return ((qa.float() @ qb.float().t()) * sa * sb).to(torch.bfloat16)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


class ScaledMMBackend(GemmBackend):
    """``torch._scaled_mm`` with a per-operand quantization granularity."""

    min_multiple = 16  # _scaled_mm needs every dim of both operands divisible by 16

    def __init__(self, name: str, granularity: str, grad_dtype: torch.dtype, fast_accum: bool = False) -> None:
        self.name = name
        self.granularity = granularity
        self.grad_dtype = grad_dtype
        self.fast_accum = fast_accum

    def is_available(self, device: torch.device | str) -> bool:
        if not hasattr(torch, "_scaled_mm"):
            return False
        if torch.device(device).type == "cpu":
            return True
        return cuda_capability_at_least(device, 8, 9)

    def quantize_a(self, a: torch.Tensor, *, is_grad: bool) -> QuantOperand:
        dtype = self.grad_dtype if is_grad else torch.float8_e4m3fn
        fused, dtypes = FUSED_QUANTIZERS.get(self.granularity, (None, ()))
        if dtype in dtypes and use_triton(a):
            return fused(a, dtype)
        q, scale_inv = quantize(a, self.granularity, dtype)
        return q.contiguous(), scale_inv

    def _mm_nt_q(self, a: QuantOperand, b: QuantOperand) -> torch.Tensor:
        (qa, sa), (qb, sb) = a, b
        return scaled_mm_nt(qa, sa, qb, sb, self.fast_accum)


# granularity -> the FP8 dtype of its gradient operands
RECIPES = {"tensorwise": torch.float8_e5m2, "rowwise": torch.float8_e4m3fn}


def scaled_mm_backends() -> dict[str, ScaledMMBackend]:
    """The ``torch._scaled_mm`` recipes, each with exact and with fast accumulation, keyed by name."""
    backends = [ScaledMMBackend(f"scaled_mm_{granularity}{FAST_ACCUM_SUFFIX if fast else ''}", granularity,
                                grad_dtype, fast)
                for fast in (False, True) for granularity, grad_dtype in RECIPES.items()]
    return {b.name: b for b in backends}
