"""A small layer's two backward GEMMs in one Triton launch: dx = dz·W and dW = dzᵀ·x (BF16 in and out, fp32
accumulation).

Notation: M rows, K in-features, N out-features; dz (M, N), x (M, K), W (N, K).

Why: at the small figure-13 shapes ((K, N) = (256, 256), (512, 512), batch 1024) each cuBLAS GEMM takes 3-4 µs
of GPU time in a replayed CUDA graph whatever its size, and the two run on two streams (a fork and a join). One
grid holding both GEMMs' tiles, launched with programmatic dependent launch (``pdl``) behind the dz kernel, took
5.3 / 5.6 µs for dz + both GEMMs against 6.8 / 10.1 µs for dz + cuBLAS on two streams on the H200; at
(256, 7680), (7680, 256) and (7680, 512) it was slower than cuBLAS (docs/kernels/README.md "Backward"), hence
``MAX_WEIGHT_ELEMENTS``. The plain GEMM loops pipeline well; also computing dz inside them (one kernel for the
whole backward) did not. Nor did computing dz in this launch by programs of its own, the GEMM programs waiting for
them on a counter (release / acquire atomics): 12.0 vs 10.8 µs a layer step at (256, 256) and 14.1 vs 12.5 at
(512, 512) on the H200 (both in CHANGELOG.md, "Tried and reverted").
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from loka_trainer.kernels import pdl
from loka_trainer.kernels.triton_env import launcher
from loka_trainer.kernels.triton_quant import fixed_or_autotuned, rows_contiguous

MAX_WEIGHT_ELEMENTS = 512 * 512  # where N·K is larger, cuBLAS on two streams was faster (module docstring)
INTERPRETER_CONFIG = {"BM_X": 16, "BK_X": 32, "BR_X": 32, "BN_W": 32, "BK_W": 16, "BR_W": 32}


def applies(M: int, K: int, N: int) -> bool:
    """True if a layer's BF16 dx and dW GEMMs run as one launch here (N·K small)."""
    return M > 0 and N * K <= MAX_WEIGHT_ELEMENTS


@functools.lru_cache(maxsize=1)
def _kernel():
    from loka_trainer.mods import triton_grads_kernels as k
    return k.grads_kernel


def grads(dz: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, config: Optional[dict] = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """dz (M, N), x (M, K), w (N, K) bf16 -> (dx = dz·W (M, K), dW = dzᵀ·x (N, K)) bf16. ``config`` (BM_X, BK_X,
    BR_X, BN_W, BK_W, BR_W, optionally num_warps / num_stages) replaces the autotuner's choice."""
    import triton
    M, N = dz.shape
    K = x.shape[1]
    dz, x, w = (rows_contiguous(t) for t in (dz, x, w))
    dx = torch.empty((M, K), dtype=torch.bfloat16, device=dz.device)
    dw = torch.empty((N, K), dtype=torch.bfloat16, device=dz.device)

    def grid(meta):
        return (triton.cdiv(M, meta["BM_X"]) * triton.cdiv(K, meta["BK_X"])
                + triton.cdiv(N, meta["BN_W"]) * triton.cdiv(K, meta["BK_W"]),)

    kernel, meta = fixed_or_autotuned(_kernel(), config, INTERPRETER_CONFIG)
    launcher(kernel, dz)[grid](dz, x, w, dx, dw, M, N, K, dz.stride(0), x.stride(0), w.stride(0), dx.stride(0),
                              dw.stride(0), **pdl.launch_args(dz), **meta)
    return dx, dw
