"""The Triton side of ``pdl`` (imports triton at module level: import this module lazily)."""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_start(PDL: tl.constexpr):
    # first thing in a kernel launched with ``pdl.launch_args``: 1 wait for the previous kernel, 2 then also let
    # the next kernel be scheduled (it waits for this one in turn, so no read moves before a write it needs)
    if PDL >= 1:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()
