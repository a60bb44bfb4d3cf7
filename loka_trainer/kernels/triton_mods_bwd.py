"""The whole BF16 backward of a small Mods layer in one Triton kernel: dz, dx = dz·W and dW = dzᵀ·x.

Notation as in ``triton_mods``: M rows, K in-features, N out-features, B the norm block, NB = N / B;
dz = r·(g − u·mean_B(g·u)), g = dh·HardSwish'(u) (``triton_mods.backward_dz``).

Why: at the small figure-13 shapes ((K, N) = (256, 256), (512, 512), batch 1024) the layer is a handful of
latency-bound kernels, and its backward is three of them (the dz kernel, then cuBLAS's dx and dW GEMMs, a few µs
each even at these sizes). Here one launch does all three. dz is never written: each program recomputes the dz
tiles it needs from dh, u and r, which costs extra reads of dh and u, so this only pays where N·K is small
(``MAX_WEIGHT_ELEMENTS``).

Two kinds of programs in one grid. dx programs own a (BLOCK_M, BLOCK_K) tile of dx and loop over the NB norm
blocks. dW programs own a (B, BLOCK_K) tile of dW and one of M_SPLITS row ranges: the reduction over M is spread
over M_SPLITS programs (one program walking all M rows was the bottleneck of an earlier one-kernel backward,
docs/kernels/README.md r11), which add their fp32 partials into a workspace with atomics; the last to arrive
(a per-tile counter) writes the tile and leaves workspace and counter zeroed for the next launch. The
workspace is therefore kept per (device, stream, N, K) and must not be used by two launches at once.

Numerics: BF16 operands, fp32 accumulation, as cuBLAS; dW's partial sums are added in arrival order, so dW
can differ between runs by fp32 rounding (not bit-reproducible).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from loka_trainer.kernels import pdl
from loka_trainer.kernels.triton_quant import interpreting

# False: the BF16 backward runs as the dz kernel + two cuBLAS GEMMs (the ``*_no_one_kernel_bwd`` benchmark
# variants time that side by side)
ENABLED = True
# the one-kernel backward runs where N·K is at most this (see the module docstring for why only there)
MAX_WEIGHT_ELEMENTS = 512 * 512
MIN_BLOCK_K = 32  # the smallest BLOCK_K of the kernel's configs (sizes the per-tile counters)
# under the interpreter: M split in 4 (the counters and the last-arrival write run), small tiles
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_K": 32, "ROWS_W": 16, "M_SPLITS": 4}


def applies(M: int, K: int, N: int, block: int) -> bool:
    """True if a (M, K) -> (N) layer's BF16 backward runs as one kernel here (``ENABLED``, small N·K)."""
    return ENABLED and N * K <= MAX_WEIGHT_ELEMENTS and N % block == 0 and K % 16 == 0 and M > 0


@functools.lru_cache(maxsize=1)
def _kernel():
    from loka_trainer.kernels import triton_mods_bwd_kernels as k
    return k.bwd_one_kernel


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 (N, K), int32 counters (N / 16 · K / MIN_BLOCK_K)) zeroed once; each launch leaves them zeroed."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (str(device), stream, N, K)
    if key not in _workspaces:
        _workspaces[key] = (torch.zeros((N, K), dtype=torch.float32, device=device),
                            torch.zeros((N // 16) * -(-K // MIN_BLOCK_K), dtype=torch.int32, device=device))
    return _workspaces[key]


def backward_one_kernel(dy: torch.Tensor, u: torch.Tensor, r: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *,
                        block: int, config: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (M, N), u (M, N) bf16, r (M, NB) fp32, x (M, K), w (N, K) bf16 -> (dx (M, K), dW (N, K)) bf16.
    ``config`` (BLOCK_M, BLOCK_K, ROWS_W, M_SPLITS, optionally num_warps) replaces the autotuner's choice."""
    import triton
    M, N = dy.shape
    K = x.shape[1]
    dy, x, w = (t if t.stride(1) == 1 else t.contiguous() for t in (dy, x, w))
    dx = torch.empty((M, K), dtype=torch.bfloat16, device=dy.device)
    dw = torch.empty((N, K), dtype=torch.bfloat16, device=dy.device)
    ws, count = _workspace(dy.device, N, K)

    def grid(meta):
        k_tiles = triton.cdiv(K, meta["BLOCK_K"])
        return (triton.cdiv(M, meta["BLOCK_M"]) * k_tiles + (N // block) * k_tiles * meta["M_SPLITS"],)

    kernel = _kernel()
    if config is None and interpreting():  # the interpreter cannot time autotune configs: one small config
        config = INTERPRETER_CONFIG
    if config is not None:
        kernel = kernel.fn
    kernel[grid](dy, u, r, x, w, dx, dw, ws, count, M, N, K, dy.stride(0), u.stride(0), r.stride(0), x.stride(0),
                 w.stride(0), dx.stride(0), dw.stride(0), BLOCK_N=block, **pdl.launch_args(dy), **(config or {}))
    return dx, dw
