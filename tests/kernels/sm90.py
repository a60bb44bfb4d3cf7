"""Offline compilation of our Triton kernels for an H100/H200 target (sm90), without a GPU: the PTX and metadata
the GPU would run, for tests of what a kernel compiles to (spills, PDL waits, vector stores, shared memory)."""
from __future__ import annotations

from typing import Optional

import pytest

SM90_SHARED_BYTES = 227 * 1024  # an H100/H200 SM's shared memory for one block


def compile_sm90(kernel, types: dict, consts: dict, *, num_warps: int = 4, num_stages: Optional[int] = None,
                 pdl: bool = True, divisible: bool = False):
    """``kernel`` (a ``triton.jit`` function) compiled for sm90: pointer arguments typed by ``types`` (name ->
    Triton type, e.g. "*bf16"), the other non-constexpr ones i32, ``consts`` the constexprs. ``divisible``: every
    pointer and integer marked divisible by 16, as Triton's launcher specializes them at aligned shapes.
    Skips the test where this triton install cannot compile for sm90 (e.g. no ptxas); a kernel that does not
    compile (wrong arguments, bad code) fails it."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in consts} if divisible else None
    source = ASTSource(kernel, signature, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
    options = {"num_warps": num_warps, "launch_pdl": pdl}
    if num_stages is not None:
        options["num_stages"] = num_stages
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except CompilationError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. no ptxas in this triton install
        pytest.skip(f"cannot compile for sm90 here: {type(e).__name__}: {str(e)[:120]}")
