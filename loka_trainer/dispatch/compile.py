"""What ``torch.compile`` needs to keep LoKA layers compiled: room for one graph per distinct layer plan."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from loka_trainer.kernels.linear import LoKALinear
from loka_trainer.mods.module import FusedLinearMods


# A compiled frame keeps one graph per distinct guard set. LoKA layers carry per-layer kernel choices (Python
# strings the graph specializes on), so N same-class blocks with different plans need N entries per grad mode
# and input dtype; past dynamo's recompile limit (default 8) the remaining ones silently run eagerly.
COMPILE_ENTRIES_PER_LAYER = 4


def reserve_compile_cache(model: nn.Module, log: Callable[[str], None]) -> None:
    """Raise dynamo's per-frame recompile limit to COMPILE_ENTRIES_PER_LAYER · (the LoKA layers of ``model``) (never
    lower it). Call it before compiling a converted model: it changes ``torch._dynamo.config`` for the process."""
    num_layers = sum(isinstance(m, (LoKALinear, FusedLinearMods)) for m in model.modules())
    if not num_layers:
        return
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    want = COMPILE_ENTRIES_PER_LAYER * num_layers
    if getattr(cfg, name) < want:
        setattr(cfg, name, want)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * want)
        log(f"torch._dynamo.config.{name} raised to {want} for {num_layers} LoKA layers (one compiled graph "
            f"per distinct layer plan, grad mode and input dtype)")
