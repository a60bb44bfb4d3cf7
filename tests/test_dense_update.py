"""trainer.warmup_steps and trainer.grad_clip_norm: the schedule is a function of the step, so a resumed run
continues it; clipping bounds the dense gradient's norm and reports the norm before clipping."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.dense_update import build_warmup, clip_gradients, warmup_factor


@pytest.mark.parametrize("step, warmup, factor", [(0, 4, 0.25), (2, 4, 0.75), (3, 4, 1.0), (50, 4, 1.0), (0, 0, 1.0)])
def test_warmup_factor_rises_linearly_then_stays_at_one(step, warmup, factor):
    assert warmup_factor(step, warmup) == pytest.approx(factor)


def _lrs(start: int, steps: int, *, warmup: int, base_lr: float = 0.1) -> list[float]:
    """The learning rate each step from `start` on runs with, the schedule built as `Trainer.fit(start)` builds it."""
    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([weight], lr=123.0)  # a checkpoint's stale value: the schedule must not use it
    sched = build_warmup(opt, base_lr=base_lr, warmup_steps=warmup, start_step=start)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        weight.grad = torch.ones(3)
        opt.step()
        if sched is not None:
            sched.step()
    return out


def test_schedule_built_at_a_resumed_step_continues_the_uninterrupted_one():
    straight = _lrs(0, 8, warmup=5)
    assert straight == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1, 0.1, 0.1, 0.1])
    assert _lrs(3, 5, warmup=5) == pytest.approx(straight[3:])


def test_no_warmup_runs_the_configured_lr_even_after_a_checkpoint_with_another():
    assert _lrs(3, 2, warmup=0) == [0.1, 0.1]


def test_clipping_scales_the_gradient_to_the_bound_and_returns_the_norm_before():
    a, b, frozen = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])  # total norm 5; `frozen` has no gradient
    norm = clip_gradients([a, b, frozen], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    total = torch.cat([a.grad, b.grad]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-4)
    torch.testing.assert_close(a.grad / b.grad.sum(), torch.tensor([0.75, 0.0]))  # direction kept
    small = torch.nn.Parameter(torch.zeros(2))
    small.grad = torch.tensor([0.3, 0.4])
    assert clip_gradients([small], max_norm=1.0).item() == pytest.approx(0.5)
    torch.testing.assert_close(small.grad, torch.tensor([0.3, 0.4]))  # under the bound: untouched
    small.grad = torch.tensor([300.0, 400.0])
    assert clip_gradients([small], max_norm=float("inf")).item() == pytest.approx(500.0)  # inf: the norm, logged only
    torch.testing.assert_close(small.grad, torch.tensor([300.0, 400.0]))
