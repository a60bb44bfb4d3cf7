"""Which Dispatch plan a resumed run uses: its own (``<run dir>/dispatch_plan.json``), never a re-timed one.

A plan decides each GEMM's kernel, hence the numerics; a checkpoint continued with another plan (timings differ
between starts: on the H200 two starts of one config chose 23 and 29 FP8 GEMMs of 54) does not continue the run
it came from. So on resume:

- ``precision.plan`` unset, the run's plan present: it is loaded like ``precision.plan=FILE`` (no measurement)
  and not rewritten.
- ``precision.plan`` unset, the run's plan missing: the run stops with one line (exit 2) and changes nothing;
  measuring a new plan would silently change the numerics. Restore the file, name a plan with
  ``precision.plan=FILE``, or start over with ``trainer.resume=false``. Unless the checkpoint records that it was
  trained without Dispatch (``precision=bf16`` + Mods continued as ``precision=loka``): there is no plan to keep
  to, so Dispatch measures one, as at a fresh start, and writes the run's plan that later resumes load.
- ``precision.plan=FILE`` given: FILE must hold the same plan as the run's own (when that exists); a different
  one stops the run with one line. Without a run plan, FILE is used and copied into the run directory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from loka_trainer.dispatch.convert import PLAN_FILE


def _content(path: Path, what: str) -> object:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be read as JSON ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def resumed_plan_file(run_dir: Path, configured: Optional[str], *, checkpoint: Path,
                      trained_with_dispatch: Optional[bool] = None) -> tuple[Optional[str], str]:
    """(the plan file a run resumed from ``checkpoint`` loads, None for a plan Dispatch measures now; a line to
    log); ValueError (one line) when the run cannot resume with the plan it was trained with.
    ``trained_with_dispatch``: what the checkpoint records (None: nothing, taken as trained with Dispatch)."""
    own = Path(run_dir) / PLAN_FILE
    if configured is None:
        if trained_with_dispatch is False and not own.exists():
            return None, (f"resuming from {checkpoint}, trained without Dispatch: Dispatch measures this run's plan "
                          f"now and writes it to {own}, which later resumes reuse")
        if not own.is_file():
            state = "is not a file" if own.exists() else "is missing"
            raise ValueError(f"resuming from {checkpoint} needs the run's Dispatch plan {own}, which {state}; "
                             f"a re-measured plan could choose other kernels and change the numerics: restore it, "
                             f"pass precision.plan=FILE, or trainer.resume=false to start over")
        return str(own), f"resuming: LoKA Dispatch reuses the run's plan {own} (not re-measured)"
    if own.is_file() and Path(configured).resolve() != own.resolve():
        if _content(Path(configured), "precision.plan") != _content(own, "the run's plan"):
            raise ValueError(f"precision.plan={configured} differs from the plan {own} that the checkpoint "
                             f"{checkpoint} was trained with; resume without precision.plan, or start over with "
                             f"trainer.resume=false")
        return str(own), f"resuming: LoKA Dispatch reuses the run's plan {own} (same as {configured})"
    return str(configured), f"resuming: LoKA Dispatch uses precision.plan={configured} (not re-measured)"
