"""SIGTERM / SIGUSR1 / Ctrl-C stop train.py at a checkpoint every rank agrees on; the same command resumes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loka_trainer.checkpoint import verify_checkpoint
from loka_trainer.stop_signal import REPEAT_WINDOW_S, RunStopped, StopSignals
from tests.launch import ROOT, SMALL, run_train

COMMON = ["model=dlrm", "trainer.log_interval=2", "trainer.eval_interval=0", "callbacks.tensorboard=false", *SMALL]


def test_the_first_signal_is_recorded_a_repeat_a_second_later_goes_to_the_handler_before_and_close_restores_it():
    calls, now = [], [0.0]
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    term_before = signal.getsignal(signal.SIGTERM)
    try:
        stop = StopSignals(enabled=True, clock=lambda: now[0])
        assert signal.getsignal(signal.SIGTERM) == stop._record
        assert stop.agreed(torch.device("cpu")) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and calls == []
        assert stop.agreed(torch.device("cpu")) == signal.SIGUSR1
        now[0] = REPEAT_WINDOW_S / 2  # the same press delivered twice (terminal + torchrun): still one
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == []
        now[0] = REPEAT_WINDOW_S * 2
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) != stop._record
        stop.close()
        assert signal.getsignal(signal.SIGTERM) == term_before
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_ctrl_c_is_announced_once_and_pressed_again_raises_keyboard_interrupt(capfd):
    now = [0.0]
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, also when pytest was started
    stop = StopSignals(enabled=True, announce=True, clock=lambda: now[0])  # with SIGINT ignored (in the background)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT
        assert "received SIGINT: stopping with a checkpoint at the next log step" in capfd.readouterr().err
        now[0] = REPEAT_WINDOW_S * 2
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes; never reached
    finally:
        stop.close()
        restored = signal.signal(signal.SIGINT, before)
    assert restored is signal.default_int_handler


def test_a_signal_ignored_when_the_loop_starts_stays_ignored():
    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as a script's background job starts with SIGINT
    stop = StopSignals(enabled=True)
    try:
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == stop._record
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert stop.received is None
    finally:
        stop.close()
        signal.signal(signal.SIGUSR1, before)
    assert signal.getsignal(signal.SIGUSR1) is before


def test_disabled_installs_nothing():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    stop = StopSignals(enabled=False)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    stop.close()
    assert RunStopped(signal.SIGUSR1, step=4, checkpoint="c").exit_status == 128 + signal.SIGUSR1


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT not ignored, also when these tests run in a background job, which does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_signal(args: list[str], run_dir: Path, *, nproc: int, signum: int) -> subprocess.CompletedProcess:
    """Start train.py for many steps, send `signum` to the launched process once a few steps are logged."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    proc = subprocess.Popen([*launcher, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal)
    deadline = time.monotonic() + 180
    while not any(r.get("step", 0) >= 4 for r in _records(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, "train.py ended or never logged"
        time.sleep(0.2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, signum", [(1, signal.SIGINT), (2, signal.SIGTERM)],
                         ids=["1_rank_ctrl_c", "2_ranks_term"])
def test_a_signal_saves_an_agreed_step_and_the_same_command_resumes_there(tmp_path, nproc, signum):
    run_dir, args = tmp_path / "run", [*COMMON, "trainer.steps=100000"]
    proc = _start_and_signal(args, run_dir, nproc=nproc, signum=signum)
    if nproc == 1:
        assert proc.returncode == 128 + signum, proc.stderr[-2000:]
    [line] = [line for line in (run_dir / "train.log").read_text().splitlines() if "stopped by" in line]
    name = signal.Signals(signum).name
    step = int(line.split(f"stopped by {name} after step ")[1].split(":")[0])
    assert step % 2 == 0  # a log step: where the ranks agree
    saved = run_dir / "checkpoints" / f"step_{step:06d}"
    assert verify_checkpoint(saved)["step"] == step and str(saved) in line
    assert max(r["step"] for r in _records(run_dir)) == step
    run_train([*COMMON, f"trainer.steps={step + 4}", f"hydra.run.dir={run_dir}"], nproc=nproc)
    assert f"resumed from {saved} at step {step}" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == list(range(2, step + 5, 2))


@pytest.mark.slow
def test_a_signal_at_a_periodic_checkpoint_and_eval_step_saves_and_evaluates_that_step(tmp_path):
    every_log_step = ["trainer.log_interval=2", "trainer.checkpoint_interval=2", "trainer.eval_interval=2"]
    run_dir, args = tmp_path / "run", [*COMMON, *every_log_step, "trainer.steps=100000"]
    proc = _start_and_signal(args, run_dir, nproc=1, signum=signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    [line] = [line for line in (run_dir / "train.log").read_text().splitlines() if "stopped by" in line]
    step = int(line.split("stopped by SIGTERM after step ")[1].split(":")[0])
    saved = run_dir / "checkpoints" / f"step_{step:06d}"
    assert str(saved) in line and verify_checkpoint(saved)["step"] == step
    assert [r["step"] for r in _records(run_dir) if "eval_auc" in r] == list(range(2, step + 1, 2))
