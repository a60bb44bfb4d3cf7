"""scripts.kernel_split: GPU kernels by kind from their names, and the re-split of rows recorded before a kind
had its own category."""
from __future__ import annotations

import pytest

from loka_trainer.profiling.kernels import is_gpu_annotation, kernel_category
from scripts.kernel_split import recategorized


@pytest.mark.parametrize("name,category", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
    ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_128x256_32x3_tn_align2>", "gemm"),
    ("fused_fwd_kernel", "gemm"),
    ("grads_kernel", "gemm"),
    ("triton_poi_fused__to_copy_clone_transpose_0", "other"),
    ("quant_rowwise_kernel", "quantization"),
    ("triton_poi_fused_quant_rowwise_zeros_3", "quantization"),
    ("triton_red_fused__to_copy_abs_clone_max_transpose_1", "quantization"),  # torchao's amax, inductor-fused
    ("triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_4", "quantization"),  # not a GEMM
    ("triton_per_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_1", "other"),
    ("norm_fwd_kernel", "epilogue"),
    ("bwd_dz_kernel", "epilogue"),
])
def test_e2e_kernel_categories(name, category):
    assert kernel_category(name) == category


def test_e2e_rows_before_the_attention_split_are_resplit_from_their_kernels():
    kernels = [["cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 5000.0, 7], ["fused_fwd_kernel", 1000.0, 8],
               ["nvjet_sm90_tst_128x192", 2000.0, 20]]
    old = {"train_gemm_ms": 9.0, "train_other_ms": 4.0, "train_top_kernels": kernels,
           "infer_gemm_ms": 1.0, "infer_other_ms": 1.0, "infer_top_kernels": []}
    new = recategorized(old)
    assert (new["train_gemm_ms"], new["train_attention_ms"], new["train_other_ms"]) == pytest.approx((5.0, 5.0, 3.0))
    assert new["infer_attention_ms"] == 0.0 and recategorized(new) is new


def test_e2e_rows_before_the_quantization_split_are_resplit_from_their_kernels():
    """A row recorded with GEMM / attention / other only: its quantization and epilogue kernels move out of
    "other", and inductor's fused cast kernel named after `_scaled_mm` moves out of "gemm"."""
    kernels = [["nvjet_sm90_qqtst_128x128", 9000.0, 20], ["quant_rowwise_kernel", 4000.0, 34],
               ["triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_4", 1000.0, 3],
               ["bwd_dz_kernel", 500.0, 8], ["multi_tensor_apply_kernel", 3000.0, 23]]
    row = {"train_gemm_ms": 10.0, "train_attention_ms": 0.0, "train_other_ms": 8.0, "train_top_kernels": kernels,
           "infer_gemm_ms": 1.0, "infer_attention_ms": 0.0, "infer_other_ms": 1.0, "infer_top_kernels": []}
    new = recategorized(row)
    got = tuple(new[f"train_{c}_ms"] for c in ("gemm", "quantization", "epilogue", "attention", "other"))
    assert got == pytest.approx((9.0, 5.0, 0.5, 0.0, 3.5))
    assert recategorized(new) is new and "train_quantization_ms" not in row


def test_e2e_rows_drop_gpu_annotations_counted_as_kernels():
    kernels = [["Optimizer.step#Adam.step", 3800.0, 1], ["multi_tensor_apply_kernel", 3700.0, 23],
               ["nvjet_sm90_tst_256x128", 2000.0, 13]]
    row = {"train_gemm_ms": 2.0, "train_attention_ms": 0.0, "train_other_ms": 8.0, "train_top_kernels": kernels,
           "infer_gemm_ms": 1.0, "infer_attention_ms": 0.0, "infer_other_ms": 1.0, "infer_top_kernels": []}
    new = recategorized(row)
    assert is_gpu_annotation(kernels[0][0]) and not any(is_gpu_annotation(k[0]) for k in kernels[1:])
    assert (new["train_gemm_ms"], new["train_other_ms"]) == pytest.approx((2.0, 4.2))
    assert [k[0] for k in new["train_top_kernels"]] == [k[0] for k in kernels[1:]]
    assert row["train_other_ms"] == 8.0 and recategorized(new) is new  # the recorded row is not modified
