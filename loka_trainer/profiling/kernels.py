"""GPU kernel kinds by kernel name: GEMM, FP8 quantization, our Mods epilogue, attention, other (the paper's
figure-11 view of a step)."""
from __future__ import annotations

# Kernel name markers per category, checked in this order (first match wins). Attention first: cuDNN's and
# CUTLASS's attention kernels also carry GEMM-like markers ("sm90_", "cutlass").
ATTENTION_MARKERS = ("sdpa", "fmha", "flash", "attention")
# cuBLAS (nvjet, sm90_*), CUTLASS, torch._scaled_mm, FBGEMM (f8f8*), inductor's GEMM templates (triton_tem_) and
# our Triton GEMM kernels (the fused Mods forward, blockwise FP8, the fused input/weight grads).
GEMM_MARKERS = ("gemm", "sm90_", "cutlass", "matmul", "_mm_", "scaled_mm", "f8f8", "nvjet", "triton_tem",
                "fused_fwd_kernel", "blockwise_kernel", "grads_kernel")
KERNEL_CATEGORIES: dict[str, tuple[str, ...]] = {
    "attention": ATTENTION_MARKERS,
    "gemm": GEMM_MARKERS,
    # FP8 casts: ours (quant_*, amax / cast / wgrad-fold kernels) and the ones inductor generates for torchao
    # (an absolute max, a reciprocal scale); a cast that inductor fused into a norm kernel counts here whole.
    "quantization": ("quant", "amax", "_abs_", "reciprocal", "cast_kernel", "fold_transpose"),
    "epilogue": ("norm_fwd_kernel", "bwd_dz_kernel"),  # our Mods epilogue (BlockNorm + HardSwish fwd, dz bwd)
}
CATEGORIES = (*KERNEL_CATEGORIES, "other")
# Inductor's generated pointwise / reduction kernels are named after the ops they fuse, a GEMM's neighbours too
# ("triton_poi_fused__scaled_mm__to_copy_clamp_..."), but never run a GEMM (its GEMM templates are "triton_tem_").
INDUCTOR_FUSED_PREFIXES = ("triton_poi_", "triton_per_", "triton_red_")

# CUDA-side events that are not kernels: torch records ranges such as ``Optimizer.step#Adam.step`` (around the
# optimizer's kernels) as GPU user annotations; counted as kernels, they add the optimizer's time twice.
GPU_ANNOTATION_MARK = "#"


def is_gpu_annotation(name: str) -> bool:
    """True for a profiler range recorded on the GPU timeline (kernel names never contain '#')."""
    return GPU_ANNOTATION_MARK in name


def kernel_category(name: str) -> str:
    """A GPU kernel's name -> "attention" | "gemm" | "quantization" | "epilogue" | "other" (``KERNEL_CATEGORIES``;
    an inductor pointwise / reduction kernel is never "gemm")."""
    low = name.lower()
    fused = low.startswith(INDUCTOR_FUSED_PREFIXES)
    return next((cat for cat, marks in KERNEL_CATEGORIES.items()
                 if not (fused and cat == "gemm") and any(m in low for m in marks)), "other")
