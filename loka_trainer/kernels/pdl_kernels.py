"""The Triton side of ``pdl`` (imports triton at module level: import this module lazily)."""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def pdl_start(PDL: tl.constexpr):
    # first thing in a kernel launched with ``pdl.launch_args``: wait for the previous kernel to end
    if PDL:
        gdc_wait()
