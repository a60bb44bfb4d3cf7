"""A small layer's two backward GEMMs in one Triton launch: dx = dz·W and dW = dzᵀ·x (BF16 in and out, fp32
accumulation).

Notation: M rows, K in-features, N out-features; dz (M, N), x (M, K), W (N, K).

Why: at the small figure-13 shapes ((K, N) = (256, 256), (512, 512), batch 1024) each cuBLAS GEMM takes 3-4 µs
of GPU time in a replayed CUDA graph whatever its size, and the two run on two streams (a fork and a join). One
grid holding both GEMMs' tiles, launched with programmatic dependent launch (``pdl``) behind the dz kernel, took
5.3 / 5.6 µs for dz + both GEMMs against 6.8 / 10.1 µs for dz + cuBLAS on two streams on the H200; at
(256, 7680), (7680, 256) and (7680, 512) it was slower than cuBLAS (docs/kernels/README.md, twelfth round), hence
``MAX_WEIGHT_ELEMENTS``. The plain GEMM loops pipeline well; the earlier attempt to also compute dz inside them
(one kernel for the whole backward) did not (r22 there).

``dz_and_grads`` (switch ``FUSE_DZ``, off until timed on a GPU) also folds the dz kernel into the launch, without
r22's mistake: dz is computed by programs of its own, as the dz kernel does, and the GEMM programs wait for all of
them inside the launch (a counter with release / acquire atomics) before running their plain GEMM loops.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from loka_trainer.kernels import pdl
from loka_trainer.kernels.triton_quant import fixed_or_autotuned

# False: the two GEMMs always run on cuBLAS (the ``*_no_grouped_grads`` benchmark variants time that side by side)
ENABLED = True
# True: the dz kernel's work runs in the same launch too (``dz_and_grads``; the ``*_dz_in_grads`` benchmark
# variants). Off until measured on a GPU: built after the thirteenth round of H200 runs, not yet timed there.
FUSE_DZ = False
MAX_WEIGHT_ELEMENTS = 512 * 512  # where N·K is larger, cuBLAS on two streams was faster (module docstring)
INTERPRETER_CONFIG = {"BM_X": 16, "BK_X": 32, "BR_X": 32, "BN_W": 32, "BK_W": 16, "BR_W": 32}


def applies(M: int, K: int, N: int) -> bool:
    """True if a layer's BF16 dx and dW GEMMs run as one launch here (``ENABLED``, N·K small)."""
    return ENABLED and M > 0 and N * K <= MAX_WEIGHT_ELEMENTS


@functools.lru_cache(maxsize=1)
def _kernel():
    from loka_trainer.kernels import triton_grads_kernels as k
    return k.grads_kernel


@functools.lru_cache(maxsize=1)
def _dz_kernel():
    from loka_trainer.kernels import triton_grads_kernels as k
    return k.dz_grads_kernel


@functools.lru_cache(maxsize=None)
def _sync_counters(device: torch.device) -> torch.Tensor:
    """``dz_grads_kernel``'s two int32 counters on ``device``, zeroed once (each launch leaves them zeroed).

    One pair per device: two of these launches must not run at once on different streams of one device (the
    backward runs them one after another on the current stream). Made at the first call, which must not be
    inside a CUDA-graph capture (the benchmark and Dispatch timers make one call before capturing)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def grads(dz: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, config: Optional[dict] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """dz (M, N), x (M, K), w (N, K) bf16 -> (dx = dz·W (M, K), dW = dzᵀ·x (N, K)) bf16. ``config`` (BM_X, BK_X,
    BR_X, BN_W, BK_W, BR_W, optionally num_warps / num_stages) replaces the autotuner's choice."""
    import triton
    M, N = dz.shape
    K = x.shape[1]
    dz, x, w = (t if t.stride(1) == 1 else t.contiguous() for t in (dz, x, w))
    dx = torch.empty((M, K), dtype=torch.bfloat16, device=dz.device)
    dw = torch.empty((N, K), dtype=torch.bfloat16, device=dz.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BM_X"]) * triton.cdiv(K, meta["BK_X"])
                + triton.cdiv(N, meta["BN_W"]) * triton.cdiv(K, meta["BK_W"]),)

    kernel, meta = fixed_or_autotuned(_kernel(), config, INTERPRETER_CONFIG)
    kernel[grid](dz, x, w, dx, dw, M, N, K, dz.stride(0), x.stride(0), w.stride(0), dx.stride(0), dw.stride(0),
                 **pdl.launch_args(dz), **meta)
    return dx, dw


def dz_and_grads(dh: torch.Tensor, u: torch.Tensor, r: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *,
                 block: int, config: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dh (M, N) bf16, u (M, N) bf16, r (M, NB) fp32 (the Mods forward's), x (M, K), w (N, K) bf16 -> (dx (M, K),
    dW (N, K)) bf16: ``triton_mods.backward_dz`` then ``grads`` in one launch. Its first programs compute dz (into
    a scratch (M, N) bf16 buffer), the rest wait for all of them inside the launch, then compute the two GEMMs
    as ``grads`` does. ``config`` as for ``grads``."""
    import triton

    from loka_trainer.kernels.triton_mods import _rows_per_program
    M, N = dh.shape
    K = x.shape[1]
    dh, u, x, w = (t if t.stride(1) == 1 else t.contiguous() for t in (dh, u, x, w))
    dz = torch.empty((M, N), dtype=torch.bfloat16, device=dh.device)
    dx = torch.empty((M, K), dtype=torch.bfloat16, device=dh.device)
    dw = torch.empty((N, K), dtype=torch.bfloat16, device=dh.device)
    dz_rows = _rows_per_program(block)

    def grid(meta):
        return (triton.cdiv(M, dz_rows) * (N // block) + triton.cdiv(M, meta["BM_X"]) * triton.cdiv(K, meta["BK_X"])
                + triton.cdiv(N, meta["BN_W"]) * triton.cdiv(K, meta["BK_W"]),)

    kernel, meta = fixed_or_autotuned(_dz_kernel(), config, INTERPRETER_CONFIG)
    kernel[grid](dh, u, r, dz, x, w, dx, dw, _sync_counters(dh.device), M, N, K, dh.stride(0), u.stride(0),
                 r.stride(0), dz.stride(0), x.stride(0), w.stride(0), dx.stride(0), dw.stride(0), BLOCK_N=block,
                 DZ_ROWS=dz_rows, **pdl.launch_args(dh), **meta)
    return dx, dw
