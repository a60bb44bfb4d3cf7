"""Stop a run cleanly on a scheduler's signal: save a checkpoint at a step every rank agrees on, then exit.

Clusters end jobs with SIGTERM (torchrun forwards it to every worker, then kills them after a grace period of
about 30 s) and SLURM can warn ahead of its time limit with SIGUSR1 (``sbatch --signal=USR1@120``). Without a
handler either one ends the process where it is, losing the steps since the last checkpoint. With
``trainer.stop_on_signal=true`` (default) `StopSignals` records the signal, and the loop asks at its next log step
(every ``trainer.log_interval`` steps, where it already synchronises the ranks) whether any rank received one: one
all-reduce, so every rank stops after the same step, saves it and exits with status 128 + the signal's number.
Running the same command again resumes there. Ctrl-C (SIGINT) does the same, and says so on rank 0. A second
signal acts as if no handler were installed (SIGTERM ends the process at once, SIGINT raises KeyboardInterrupt),
except a repeat within `REPEAT_WINDOW_S`: one Ctrl-C under torchrun reaches each rank twice (from the terminal,
and forwarded by torchrun). A signal ignored when the loop starts stays ignored (a shell script's background job
ignores SIGINT), as Python itself leaves an ignored SIGINT alone.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_WINDOW_S = 1.0


class RunStopped(Exception):
    """The loop stopped on a signal after `step`, having saved `checkpoint`."""

    def __init__(self, signum: int, *, step: int, checkpoint: Any) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {checkpoint}; "
                         f"run the same command again to resume from it")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Records the first of `STOP_SIGNALS` this process receives (handlers only in the main thread, where Python
    runs them, and only for signals not ignored (``SIG_IGN``) when it is made; elsewhere, and with ``enabled=False``,
    nothing is installed and no signal is ever recorded).
    ``announce``: write one line to stderr when the first arrives (rank 0). ``clock``: seconds, for the repeat window.
    """

    def __init__(self, *, enabled: bool, announce: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.received: Optional[int] = None
        self._received_at = 0.0
        self._announce, self._clock = announce, clock
        self._previous: dict[int, Any] = {}
        if enabled and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        now = self._clock()
        if self.received is None:
            self.received, self._received_at = signum, now
            if self._announce:  # os.write: a signal handler must not take the logging module's locks
                os.write(2, f"received {signal.Signals(signum).name}: stopping with a checkpoint at the next log "
                            f"step; send it again to stop at once\n".encode())
            return
        if signum == self.received and now - self._received_at < REPEAT_WINDOW_S:
            return  # the same signal delivered twice
        previous = self._previous.get(signum, signal.SIG_DFL)
        signal.signal(signum, previous)  # from now on it acts as before
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    def agreed(self, device: torch.device) -> Optional[int]:
        """Collective: the signal any rank received (the largest number when several did), or None."""
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return value or None

    def close(self) -> None:
        """Put back the handlers that were there before."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


__all__ = ["RunStopped", "STOP_SIGNALS", "StopSignals"]
