"""Benchmark variants that time a fused layer with one of the kernels' module-level switches flipped for the whole
step (forward and backward), to measure what the default behaviour gains (or an opt-in one would: a switch sets
its flag either way) side by side in one run."""
from __future__ import annotations

import importlib

# variant-name suffix -> (module, boolean attribute, its value while such a variant's step runs)
SWITCHES = {
    "serial_grads": ("loka_trainer.mods.streams", "ENABLED", False),  # the backward's dx and dW GEMMs in order
    "no_split_k": ("loka_trainer.mods.triton_mods", "CUBLAS_SPLIT_K", False),  # the split modes' BF16 GEMM unsplit
    "no_pdl": ("loka_trainer.kernels.pdl", "ENABLED", False),  # our kernels launched without programmatic dependence
    "no_grouped_grads": ("loka_trainer.mods.triton_grads", "ENABLED", False),  # a small layer's dx, dW on cuBLAS
    # the split FP8 forward on cuBLASLt's rowwise-scaled GEMM instead of unit-scale tensorwise + epilogue scales
    "rowwise_gemm": ("loka_trainer.mods.ops", "UNIT_SCALE_FP8_GEMM", False),
    # the split modes' epilogue writes u for the backward instead of the backward recomputing it from z
    "save_u": ("loka_trainer.mods.ops", "SAVE_Z", False),
    # the split FP8 forward's GEMM with exact accumulation instead of cuBLASLt's fast accumulation
    "exact_fwd_accum": ("loka_trainer.mods.ops", "FP8_FORWARD_FAST_ACCUM", False),
}


def switched_variant(f, switch: str):
    """``f`` (x -> y) marked so that its benchmark step runs with ``SWITCHES[switch]`` flipped (``with_switch``)."""
    if switch not in SWITCHES:
        raise ValueError(f"unknown switch {switch!r}; valid: {sorted(SWITCHES)}")

    def call(x):
        return f(x)
    call.switch = switch
    return call


def with_switch(step, switch: str):
    """``step`` with ``SWITCHES[switch]``'s attribute at its variant value for the whole call (a backward inside it
    too), restored after."""
    module_name, flag, value = SWITCHES[switch]
    module = importlib.import_module(module_name)

    def call():
        default = getattr(module, flag)
        setattr(module, flag, value)
        try:
            return step()
        finally:
            setattr(module, flag, default)
    return call
