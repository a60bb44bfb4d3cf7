"""GPU kernel time of one training or inference step by kind (``loka_trainer.profiling.kernels``), as
``bench_e2e_gpu`` records it, and the re-split of rows recorded before a kind had its own category."""
from __future__ import annotations

import torch

from loka_trainer.profiling.kernels import ATTENTION_MARKERS, CATEGORIES, is_gpu_annotation, kernel_category

PHASES = ("train", "infer")  # the step kinds a bench_e2e row splits: "<phase>_<category>_ms"

# The GEMM markers before ``KERNEL_CATEGORIES`` existed (JSON without "*_attention_ms" was split by these).
LEGACY_GEMM_MARKERS = ("gemm", "sm90_", "cutlass", "matmul", "_mm_", "scaled_mm", "f8f8", "nvjet", "triton_tem")
# The split of rows recorded before quantization and epilogue had their own categories (JSON without
# "*_quantization_ms"): attention, GEMM (inductor's fused pointwise kernels named after a GEMM included), other.
SPLIT_BEFORE_QUANTIZATION: dict[str, tuple[str, ...]] = {
    "attention": ATTENTION_MARKERS,
    "gemm": (*LEGACY_GEMM_MARKERS, "fused_fwd_kernel", "blockwise_kernel"),
}


def category_before_attention_split(name: str) -> str:
    """Where a row recorded before the attention split (JSON without "*_attention_ms") counted a kernel."""
    return "gemm" if any(m in name.lower() for m in LEGACY_GEMM_MARKERS) else "other"


def category_before_quantization_split(name: str) -> str:
    """Where a row recorded before the quantization / epilogue split counted a kernel
    (``SPLIT_BEFORE_QUANTIZATION``)."""
    low = name.lower()
    return next((cat for cat, marks in SPLIT_BEFORE_QUANTIZATION.items() if any(m in low for m in marks)), "other")


def kernel_split_ms(fn, top: int = 40) -> dict:
    """GPU kernel time of one call of `fn` per ``kernel_category`` (``gemm_ms``, ``attention_ms``, ``other_ms``),
    plus the ``top`` kernels by time as [name[:90], µs, calls] and the ``top`` host-side ops by self CPU time
    (where a launch-bound step spends its Python/dispatcher time) as [name[:90], self µs, calls]."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    # A discarded profiled call first: entering the profiler can make dynamo recompile (and inductor autotune)
    # on the next call, which must not be counted as the step's kernels.
    with profile(activities=activities):
        fn()
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    ms = dict.fromkeys(CATEGORIES, 0.0)
    kernels, host = [], []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type.name == "CPU" and evt.self_cpu_time_total > 0:
            host.append([evt.key[:90], round(evt.self_cpu_time_total, 1), evt.count])
        if (evt.device_type.name != "CUDA" or t <= 0 or getattr(evt, "is_user_annotation", False)
                or is_gpu_annotation(evt.key)):
            continue
        kernels.append([evt.key[:90], round(t, 1), evt.count])
        ms[kernel_category(evt.key)] += t / 1e3
    kernels.sort(key=lambda k: -k[1])
    host.sort(key=lambda k: -k[1])
    return {**{f"{cat}_ms": v for cat, v in ms.items()}, "top_kernels": kernels[:top], "top_host_ops": host[:top]}


def recategorized(row: dict) -> dict:
    """A recorded row with its ``train_``/``infer_`` per-category times corrected from the kernels it lists (its top
    kernels only: kernels below that list stay where they were counted):
    - GPU annotations (``is_gpu_annotation``; counted as kernels before ``kernel_split_ms`` skipped them) are
      dropped from the list and from their category: their time was other kernels' time counted twice;
    - rows written before the attention split, or before the quantization / epilogue split, are re-split by
      ``kernel_category``.
    Rows needing neither come back unchanged (the same object)."""
    if "train_top_kernels" not in row:
        return row
    if "train_attention_ms" not in row:
        counted = category_before_attention_split
    elif "train_quantization_ms" not in row:
        counted = category_before_quantization_split
    else:
        counted = kernel_category
    annotated = any(is_gpu_annotation(k[0]) for phase in PHASES for k in row.get(f"{phase}_top_kernels", []))
    if counted is kernel_category and not annotated:
        return row
    out = dict(row)
    for phase in PHASES:
        ms = {cat: row.get(f"{phase}_{cat}_ms", 0.0) for cat in CATEGORIES}
        kept = []
        for name, us, calls in row.get(f"{phase}_top_kernels", []):
            ms[counted(name)] -= us / 1e3
            if not is_gpu_annotation(name):
                ms[kernel_category(name)] += us / 1e3
                kept.append([name, us, calls])
        out.update({f"{phase}_{cat}_ms": v for cat, v in ms.items()})
        out[f"{phase}_top_kernels"] = kept
    return out
