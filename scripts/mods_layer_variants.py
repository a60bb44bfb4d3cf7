"""The Mods layer variants the GPU benchmarks time at the paper's figure-13 shapes (suite (b) of
``scripts.bench_dispatch_gpu``, ``benchmarks.profile_mods_layers_gpu``): their names, the default set, and
``build_mods_layer_variants`` building them at one shape. Forward callables x -> y; the base is Linear(bias) ->
LayerNorm -> SiLU, the Mods are no bias -> BlockNorm -> HardSwish (``loka_trainer.mods.reference``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from loka_trainer.mods.config import ModsKernelConfig
from loka_trainer.mods.reference import block_norm, hard_swish

MODS_LAYER_SHAPES = [(256, 256), (7680, 256), (512, 512), (7680, 512), (4096, 2048), (4096, 2560), (2048, 4096),
                     (2560, 4096), (256, 7680)]  # (K in, N out), the paper's figure 13
BATCH = 1024
FUSED_VARIANTS = {
    "fused_bf16": dict(mode="fused_bf16"),
    "split_bf16": dict(mode="split_bf16"),
    "fused_fp8_fwd": dict(mode="fused_fp8"),
    "fused_fp8_all": dict(mode="fused_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_rowwise"),
    # split_fp8: quant_rowwise(x) + torch._scaled_mm (e4m3 W) + the Triton epilogue kernel.
    # dgrad scaled_mm_rowwise runs fused in linear_mods: dz kernel writes the amax, one cast kernel, _scaled_mm.
    "split_fp8_fwd": dict(mode="split_fp8"),
    "split_bf16_fp8_dgrad": dict(mode="split_bf16", dgrad="scaled_mm_rowwise"),
    "split_fp8_dgrad": dict(mode="split_fp8", dgrad="scaled_mm_rowwise"),
    # the dgrad on tensorwise FP8 (e5m2 dz; the dz kernel folds its amax into one scalar, then one cast pass):
    # cuBLAS's tensorwise FP8 GEMM is faster than its rowwise one at every shape here
    # (benchmarks/bench_mods_layer_gemms_gpu.py)
    "split_bf16_tw_dgrad": dict(mode="split_bf16", dgrad="scaled_mm_tensorwise"),
    "split_fp8_tw_dgrad": dict(mode="split_fp8", dgrad="scaled_mm_tensorwise"),
    "fused_fp8_dgrad": dict(mode="fused_fp8", dgrad="scaled_mm_rowwise"),  # the fused FP8 forward + FP8 dgrad
    "split_fp8_all": dict(mode="split_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_rowwise"),
    # the weight grad on tensorwise FP8 from the forward's FP8 x, its row scales folded into dz (``wgrad_fold``;
    # quantizing dzᵀ and xᵀ in separate passes instead was no faster than split_fp8_all: CHANGELOG.md)
    "split_fp8_dgrad_tw_wgrad": dict(mode="split_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_tensorwise"),
    "split_fp8_tw_grads": dict(mode="split_fp8", dgrad="scaled_mm_tensorwise", wgrad="scaled_mm_tensorwise"),
    "fused_fp8_dgrad_tw_wgrad": dict(mode="fused_fp8", dgrad="scaled_mm_rowwise", wgrad="scaled_mm_tensorwise"),
    # the backward's FP8 GEMMs on cuBLASLt's fast accumulation (backends_scaled_mm), suffix "_fa"
    "split_bf16_tw_dgrad_fa": dict(mode="split_bf16", dgrad="scaled_mm_tensorwise_fast_accum"),
    "split_fp8_dgrad_fa": dict(mode="split_fp8", dgrad="scaled_mm_rowwise_fast_accum"),
    "split_fp8_tw_dgrad_fa": dict(mode="split_fp8", dgrad="scaled_mm_tensorwise_fast_accum"),
    "split_fp8_dgrad_tw_wgrad_fa": dict(mode="split_fp8", dgrad="scaled_mm_rowwise_fast_accum",
                                        wgrad="scaled_mm_tensorwise_fast_accum"),
    "split_fp8_tw_grads_fa": dict(mode="split_fp8", dgrad="scaled_mm_tensorwise_fast_accum",
                                  wgrad="scaled_mm_tensorwise_fast_accum"),
}

# variants also timed with dx and dW computed one after the other (``<name>_serial_grads``: the layer's
# ``ModsKernelConfig(backward_streams=False)``; by default ``streams.side_by_side`` runs them on two streams)
SERIAL_GRADS_VARIANTS = ("split_bf16", "split_fp8_dgrad", "fused_fp8_fwd", "split_fp8_tw_dgrad")
SERIAL_GRADS = ModsKernelConfig(backward_streams=False)
COMPILED_VARIANTS = ("base_compiled", "mods_compiled", "ablate_no_bias", "ablate_blocknorm", "ablate_hardswish")
ALL_MODS_LAYER_VARIANTS = ("base_eager", *COMPILED_VARIANTS, "torchao_rowwise_mods_compiled", *FUSED_VARIANTS,
                           *(f"{n}_serial_grads" for n in SERIAL_GRADS_VARIANTS))
# what suite (b) times unless told otherwise: the comparisons (base eager and compiled, the Mods and
# torchao FP8 + Mods compiled, the ablation) and the fused modes that were the fastest at some shape in a run on
# the H200 (docs/kernels/README.md "The current layer table"; earlier runs in CHANGELOG.md);
# ``--mods-layer-variants all`` adds the rest (modes never fastest, the serial-grads variants)
DEFAULT_MODS_LAYER_VARIANTS = ("base_eager", *COMPILED_VARIANTS, "torchao_rowwise_mods_compiled", "split_bf16",
                               "fused_bf16", "fused_fp8_fwd", "split_fp8_dgrad", "fused_fp8_dgrad",
                               "split_fp8_tw_dgrad", "split_fp8_dgrad_tw_wgrad", "split_bf16_tw_dgrad_fa",
                               "split_fp8_dgrad_tw_wgrad_fa", "split_fp8_tw_grads_fa")


def mods_layer_variant_names(arg: Optional[str]) -> tuple[str, ...]:
    """``--mods-layer-variants``: None or "default" -> DEFAULT_MODS_LAYER_VARIANTS, "all" -> every variant, else
    the comma-separated names (an unknown name raises ValueError naming it and the valid ones)."""
    if arg in (None, "default"):
        return DEFAULT_MODS_LAYER_VARIANTS
    if arg == "all":
        return ALL_MODS_LAYER_VARIANTS
    names = tuple(n for n in arg.split(",") if n)
    unknown = [n for n in names if n not in ALL_MODS_LAYER_VARIANTS]
    if unknown or not names:
        raise ValueError(f"unknown Mods layer variant(s) {unknown}; valid: default, all, or names from "
                         f"{', '.join(ALL_MODS_LAYER_VARIANTS)}")
    return names


def build_mods_layer_variants(K: int, N: int, only: Optional[set] = None) -> tuple[dict, list[torch.Tensor]]:
    """(name -> forward fn(x) -> y for one layer (K in, N out), the layer's parameters); compiled variants are
    built only if kept."""
    dev, bf = "cuda", torch.bfloat16
    w = (torch.randn(N, K, device=dev, dtype=bf) / math.sqrt(K)).requires_grad_()
    b = torch.zeros(N, device=dev, dtype=bf, requires_grad=True)
    ln_w = torch.ones(N, device=dev, dtype=bf, requires_grad=True)
    ln_b = torch.zeros(N, device=dev, dtype=bf, requires_grad=True)
    base = lambda x: F.silu(F.layer_norm(F.linear(x, w, b), (N,), ln_w, ln_b))
    no_bias = lambda x: F.silu(F.layer_norm(F.linear(x, w), (N,), ln_w, ln_b))
    bnorm = lambda x: F.silu(block_norm(F.linear(x, w, b)))
    hswish = lambda x: hard_swish(F.layer_norm(F.linear(x, w, b), (N,), ln_w, ln_b))
    mods = lambda x: hard_swish(block_norm(F.linear(x, w)))
    keep = lambda name: only is None or name in only
    v = {"base_eager": base}
    for name, f in zip(COMPILED_VARIANTS, (base, mods, no_bias, bnorm, hswish)):
        if keep(name):  # dynamic=False: each shape gets its own specialized graph (no dynamic-shape kernels)
            v[name] = torch.compile(f, dynamic=False)
    from loka_trainer.mods.ops import linear_mods
    if K % 16 == 0 and N % 256 == 0:
        # no cache passed: each call casts its FP8 weights, as a training step does after the optimizer's step
        # (torchao's recipes cast per call too)
        for name, kw in FUSED_VARIANTS.items():
            v[name] = lambda x, kw=kw: linear_mods(x, w, **kw)
        for name in SERIAL_GRADS_VARIANTS:
            v[f"{name}_serial_grads"] = (lambda x, kw=FUSED_VARIANTS[name]:
                                         linear_mods(x, w, config=SERIAL_GRADS, **kw))
    try:
        if not keep("torchao_rowwise_mods_compiled"):
            raise ImportError
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        lin = torch.nn.Linear(K, N, bias=False, device=dev, dtype=bf)
        recipe = Float8LinearConfig.from_recipe_name("rowwise")
        seq = convert_to_float8_training(torch.nn.Sequential(lin), config=recipe)
        v["torchao_rowwise_mods_compiled"] = torch.compile(lambda x: hard_swish(block_norm(seq(x))), dynamic=False)
        params = [lin.weight]
    except ImportError:
        params = []
    return {k: f for k, f in v.items() if keep(k)}, [w, b, ln_w, ln_b, *params]
