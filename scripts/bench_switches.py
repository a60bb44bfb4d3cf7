"""Benchmark variants that time a fused layer with one of the kernels' module-level switches off for the whole
step (forward and backward), to measure what the switched-on behaviour gains side by side in one run."""
from __future__ import annotations

import importlib

# variant-name suffix -> (module, boolean attribute) switched off while such a variant's step runs
SWITCHES = {
    "serial_grads": ("loka_trainer.kernels.streams", "ENABLED"),  # the backward's dx and dW GEMMs in order
    "no_split_k": ("loka_trainer.kernels.triton_mods", "CUBLAS_SPLIT_K"),  # the split modes' BF16 GEMM unsplit
    "no_pdl": ("loka_trainer.kernels.pdl", "ENABLED"),  # our kernels launched without programmatic dependence
    "no_grouped_grads": ("loka_trainer.kernels.triton_grads", "ENABLED"),  # a small layer's dx, dW on cuBLAS
    # the split FP8 forward on cuBLASLt's rowwise-scaled GEMM instead of unit-scale tensorwise + epilogue scales
    "rowwise_gemm": ("loka_trainer.kernels.mods_ops", "UNIT_SCALE_FP8_GEMM"),
}


def switched_variant(f, switch: str):
    """``f`` (x -> y) marked so that its benchmark step runs with ``SWITCHES[switch]`` off (``with_switch_off``)."""
    if switch not in SWITCHES:
        raise ValueError(f"unknown switch {switch!r}; valid: {sorted(SWITCHES)}")

    def call(x):
        return f(x)
    call.switch_off = switch
    return call


def with_switch_off(step, switch: str):
    """``step`` with ``SWITCHES[switch]`` False for the whole call (a backward inside it too), restored after."""
    module_name, flag = SWITCHES[switch]
    module = importlib.import_module(module_name)

    def call():
        setattr(module, flag, False)
        try:
            return step()
        finally:
            setattr(module, flag, True)
    return call
