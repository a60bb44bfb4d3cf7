"""What a non-finite loss or gradient does to a run: ``trainer.nonfinite`` = ``error`` | ``skip_step``.

``error`` (default): each step records on the device, without a host sync, the first step (1-based, as in
metrics.jsonl) whose loss or dense gradient was non-finite on any rank. `NonFiniteGuard.first_bad` (one
all-reduce) runs before every metrics record, evaluation and checkpoint and at the end of training; the trainer
then stops with one line naming that step. Nothing computed from the non-finite state is logged or saved, so
``latest`` stays the last good checkpoint (steps between the bad one and the next check are computed, then
discarded).

``skip_step``: the loss is checked before backward on every step (an all-reduce and a host sync per step).
When it is non-finite on any rank, every rank skips backward and both optimizer steps: TorchRec's fused
embedding optimizer updates the tables inside backward, so skipping backward is what skips the embedding
update; the dense optimizer's step and state are untouched too. That batch is consumed, not retried. Skips
are counted (``skipped_steps`` in metrics.jsonl and summary.json). A *finite* loss with a non-finite dense
gradient cannot be skipped honestly (the embedding update has already happened inside backward), so it stops
the run as under ``error``.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

NONFINITE_POLICIES = ("error", "skip_step")
_NEVER = 2 ** 62
_KINDS = ("loss", "gradient")


class NonFiniteError(RuntimeError):
    """The run met a non-finite loss or gradient; the message is one line naming the step."""


class NonFiniteGuard:
    """Per-run detector. `step` arguments are 1-based step numbers (the `step` of metrics.jsonl)."""

    def __init__(self, policy: str, *, device: torch.device):
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"trainer.nonfinite={policy!r} is not one of {', '.join(NONFINITE_POLICIES)}")
        self.policy = policy
        self.skipped_steps = 0
        self._first = torch.full((len(_KINDS),), _NEVER, dtype=torch.int64, device=device)  # per kind

    def skip(self, loss: torch.Tensor, step: int) -> bool:
        """Whether every rank must skip this step (``skip_step`` and a non-finite loss on any rank); under
        ``error`` the step is only recorded and this returns False without a host sync."""
        bad = ~torch.isfinite(loss.detach()).all()
        if self.policy != "skip_step":
            self._record(0, bad, step)
            return False
        flag = bad.to(torch.int32).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self.skipped_steps += 1
            return True
        return False

    def record_gradients(self, grads: Iterable[Optional[torch.Tensor]], step: int) -> None:
        """Record whether this rank's part of the dense gradient holds a NaN or inf (its max-norm: a 2-norm
        would overflow for large finite gradients; no host sync)."""
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads if g is not None]
        local = [g for g in local if g.numel()]  # an FSDP2 shard can be empty on some ranks
        if local:
            norm = torch.nn.utils.get_total_norm(local, norm_type=float("inf"), error_if_nonfinite=False)
            self._record(1, ~torch.isfinite(norm), step)

    def first_bad(self) -> Optional[tuple[str, int]]:
        """Collective: ("loss" | "gradient", first non-finite step over all ranks), or None."""
        first = self._first.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        steps = first.tolist()
        step = min(steps)
        return None if step >= _NEVER else (_KINDS[steps.index(step)], step)

    def _record(self, kind: int, bad: torch.Tensor, step: int) -> None:
        candidate = torch.where(bad, torch.full_like(self._first[kind], step), self._first[kind])
        self._first[kind] = torch.minimum(self._first[kind], candidate)


__all__ = ["NONFINITE_POLICIES", "NonFiniteError", "NonFiniteGuard"]
