"""Timing a small kernel's autotune configs by GPU time from CUDA-graph replay (imports triton: import this module
lazily, from kernel modules). Used by ``triton_grads_kernels`` (small layers only).

Why: Triton's default benchmarker times eager launches. The grouped backward GEMMs take 3-5 µs of GPU time at
batch 1024, less than a launch, so eager timing ranks their configs by noise: on the H200 its autotuner picked,
at (K, N) = (256, 256), a config of 3.74 µs by graph replay over one of 3.34 µs. Not for large kernels: replay
keeps their operands in L2, which eager timing flushes, and the fused forward's picks by replay were slower at the
large figure-13 shapes (docs/kernels/README.md "Backward", Launch; CHANGELOG.md "Tried and reverted").
Autotuning runs at a kernel's first call for a new key, which must not be inside a CUDA-graph capture (the
benchmark and Dispatch timers make one call before capturing).
"""
from __future__ import annotations

import torch
import triton.testing


def graph_replay_bench(kernel_call, quantiles):
    """``triton.autotune(do_bench=...)``: the (median, 20th, 80th percentile) ms of one ``kernel_call`` replayed in
    a CUDA graph. The timing runs on a stream of its own: synchronize first, so the inputs are ready."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)
