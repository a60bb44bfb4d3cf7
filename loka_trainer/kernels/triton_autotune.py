"""How our autotuned Triton kernels time their configs: GPU time from CUDA-graph replay (imports triton: import
this module lazily, from kernel modules).

Why: Triton's default benchmarker times eager launches. The fused layer's kernels take 2-5 µs of GPU time at
batch 1024, less than a launch, so eager timing ranks configs by noise: on the H200 the autotuner of the grouped
backward GEMMs picked, at (K, N) = (256, 256), a config 3.74 µs by graph replay over one of 3.34 µs
(docs/kernels/README.md, thirteenth round). Graph replay is also how the layers are timed and run in training.
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
