"""One plan for every rank: rank 0 measures, the others receive its plan (no-op without torch.distributed)."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from loka_trainer.dispatch.plan import DispatchPlan


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def rank0_print(msg: str) -> None:
    if is_rank0():
        print(msg, flush=True)


def broadcast_plan(plan: Optional[DispatchPlan]) -> DispatchPlan:
    """Rank 0's plan on every rank, so all ranks run the same kernels (no-op without distributed)."""
    if not dist.is_initialized():
        assert plan is not None
        return plan
    obj = [plan.to_dict() if plan is not None else None]
    dist.broadcast_object_list(obj, src=0)
    return DispatchPlan.from_dict(obj[0])
