"""Programmatic dependent launch (PDL, CUDA sm90+) for our Triton kernels: the switches and the launch keywords.

A kernel launched with PDL may be scheduled while the kernel before it in the stream drains. Each of our kernels
starts with ``pdl_kernels.pdl_start``: ``gdc_wait`` (no memory access before the previous kernel has finished and
its writes are visible), then, with ``EARLY_TRIGGER``, ``gdc_launch_dependents`` (the next kernel may be scheduled
once all of this kernel's programs have started, instead of once they have exited). In a replayed CUDA graph
this hides part of each launch gap. Results do not change: every read still follows the previous kernel's end.

Levels passed to a kernel as its ``PDL`` constexpr: 0 plain launch, 1 wait, 2 wait + early trigger.
"""
from __future__ import annotations

import functools

import torch

from loka_trainer.kernels.triton_quant import interpreting

# False: plain launches (the ``*_no_pdl`` benchmark variants time that side by side)
ENABLED = True
# False: the next kernel is scheduled when this one's programs exit (the ``*_late_trigger`` benchmark variants)
EARLY_TRIGGER = True


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def active(t: torch.Tensor) -> bool:
    """True if kernels on ``t``'s device launch with PDL (``ENABLED``, CUDA sm90+, not the interpreter)."""
    return ENABLED and t.is_cuda and not interpreting() and _supported(t.device.index or 0)


def level(t: torch.Tensor) -> int:
    """The ``PDL`` constexpr of a kernel launched on ``t``'s device: 0 off, 1 wait, 2 wait + early trigger."""
    if not active(t):
        return 0
    return 2 if EARLY_TRIGGER else 1


def launch_args(t: torch.Tensor) -> dict:
    """A launch's PDL keywords: the kernel's ``PDL`` level (``pdl_kernels.pdl_start``) and Triton's
    ``launch_pdl``."""
    lvl = level(t)
    return {"PDL": lvl, "launch_pdl": lvl > 0}
