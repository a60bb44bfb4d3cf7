"""Which (K -> N) layers with a BlockNorm block the fused Mods kernels run: pure shape rules, no Triton import."""
from __future__ import annotations

from typing import Optional

from loka_trainer.mods.reference import DEFAULT_BLOCK


def unsupported_reason(K: int, N: int, block: int = DEFAULT_BLOCK) -> Optional[str]:
    """Why the Triton kernels cannot run a (K -> N) layer with this norm block, in a few words; None if they can."""
    if block & (block - 1) or not 16 <= block <= 256:
        return f"block {block} is not a power of 2 in [16, 256]"
    if N % block:
        return f"N={N} is not a multiple of the block {block}"
    if K % 16:
        return f"K={K} is not a multiple of 16"
    return None


def supports(K: int, N: int, block: int = DEFAULT_BLOCK) -> bool:
    """True if the Triton kernels can run a (K -> N) layer with this norm block."""
    return unsupported_reason(K, N, block) is None
