"""Helpers for running the project's Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1).

NOTE: triton 3.6's interpreter converts a scalar loop bound with ``int(ndarray_of_shape_(1,))``, which
numpy >= 2.4 rejects ("only 0-dimensional arrays can be converted"); ``patch_interpreter`` makes that
conversion take the single element instead. It changes nothing on a GPU (the interpreter is not used there).

NOTE: triton 3.6's interpreter stores bfloat16 as its uint16 bits and its ``tl.dot`` multiplies those integers;
``patch_interpreter`` also makes a bf16 dot widen its operands to fp32 first (what the GPU's bf16 MMA with an
fp32 accumulator computes, up to summation order).
"""
from __future__ import annotations

import importlib.util

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")


def patch_interpreter() -> None:
    """Idempotently fix the interpreter's tensor -> int conversion for numpy >= 2.4 and its bf16 tl.dot."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp._patch_lang_tensor, "_loka_patched", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._loka_patched = True
    interp._patch_lang_tensor = patched

    builder = interp.InterpreterBuilder
    original_dot = builder.create_dot

    def dot_widening_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widened(t):
            if t.dtype.scalar != tl.bfloat16:
                return t
            data = interp._convert_float(t.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return original_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot_widening_bf16


@pytest.fixture
def interpret(monkeypatch):
    """Run Triton kernels on CPU tensors through the interpreter for the duration of one test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    patch_interpreter()
    yield
