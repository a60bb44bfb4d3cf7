"""Programmatic dependent launch (PDL, CUDA sm90+) for our Triton kernels: the launch keywords.

A kernel launched with PDL may be scheduled while the kernel before it in the stream drains. Each of our kernels
starts with ``pdl_kernels.pdl_start``: ``gdc_wait``, no memory access before the previous kernel has finished and
its writes are visible. In a replayed CUDA graph this hides part of each launch gap; results do not change.

The next kernel is scheduled when this one's programs exit. Calling ``gdc_launch_dependents`` first thing instead
(the next kernel scheduled once all of this one's programs have started) was measured on the H200 and not kept:
no faster in the split and BF16 modes, up to 5% slower with the fused FP8 forward (CHANGELOG.md, "Tried and
reverted"). Plain launches are not offered: with PDL the fused layer was faster in 33 of 36 (mode, shape) pairs on
the H200 and at most 0.53 µs slower in the other three (docs/kernels/README.md "Backward", pdl_2026-11-30.json).
"""
from __future__ import annotations

import functools

import torch

from loka_trainer.kernels.triton_env import interpreting, traced

@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def active(t: torch.Tensor) -> bool:
    """True if kernels on ``t``'s device launch with PDL (CUDA sm90+, not the interpreter), and the launch is made
    by our Python, not traced into a compiled graph: there inductor launches the kernel, and its mutation analysis
    cannot read PDL's inline asm (it would take every argument as written, and copy inputs before the launch)."""
    # traced first: compiled code never traces the environment lookup of interpreting()
    return t.is_cuda and not traced(t) and not interpreting() and _supported(t.device.index or 0)


def launch_args(t: torch.Tensor) -> dict:
    """A launch's PDL keywords: the kernel's ``PDL`` constexpr (``pdl_kernels.pdl_start``), and Triton's
    ``launch_pdl`` only when on (a traced launch carries no keyword inductor does not know)."""
    on = active(t)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
