"""`train.py`'s body: compose + validate the config (no process group yet), decide where the run starts, then
start ranks and train.

    python train.py model=wukong precision=loka trainer.steps=300 hydra.run.dir=DIR
    torchrun --nproc_per_node=2 train.py model=wukong ...

Order, so that nothing in the run directory is overwritten before the resume decision (`loka_trainer.resume`):
config -> resume decision (every rank reads the same files; no checkpoint usable: exit 2; a resumed LoKA run loads
its own Dispatch plan, `dispatch.reuse`, or stops when it is missing; a change of precision is named in one line,
`resume.precision_change`; every rank's saved data position must fit the data settings and its Probe statistics
``callbacks.probe``, checked on each rank) -> a fresh start moves an earlier run's outputs aside (rank 0) -> logging
-> process group -> model -> load the checkpoint -> record `.hydra/` -> train. Exit status: 2 for a bad config, an
unusable checkpoint or a failed save, 3 for a non-finite loss or gradient under ``trainer.nonfinite=error``; each
with one ``error:`` line on stderr (rank 0). 128 + N after signal N (SIGTERM, SIGUSR1, SIGINT) stopped the run at a
checkpoint (`loka_trainer.stop_signal`).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn, Optional

from omegaconf import DictConfig, OmegaConf

from loka_trainer.callbacks.probe_config import probe_out_dir
from loka_trainer.checkpoint import CheckpointError
from loka_trainer.cli import fail, parse_argv, run_app, typed_config, unwritable_line, write_run_config
from loka_trainer.config import build_small_model, check_plan_file, register_schemas, to_run_config
from loka_trainer.nonfinite import NonFiniteError
from loka_trainer.output_dirs import RunDirInUse, RunDirLock
from loka_trainer.precision import precision_identity
from loka_trainer.resume import (METRICS_FILE, SUMMARY_FILE, StartPlan, checkpoint_root, model_identity, nothing_left,
                                 plan_start, precision_change, prepare_resumed_run, set_aside_previous_run,
                                 set_aside_probe_outputs, summary_steps)
from loka_trainer.sharding.dist import init_distributed, launch_env, shutdown_distributed
from loka_trainer.stop_signal import RunStopped

EXIT_NONFINITE = 3


def setup_logging(run_dir: Path, *, rank: int) -> None:
    """Rank 0 logs our INFO lines to stdout and `run_dir/train.log`; libraries and other ranks only warnings."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if rank == 0:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(level=logging.WARNING, handlers=handlers, force=True,
                        format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("loka_trainer").setLevel(logging.INFO if rank == 0 else logging.WARNING)


def main(argv: Optional[list[str]] = None) -> None:
    """Hydra's command line (``--help``, ``--cfg job``, ``-m``...); every run is checked before the first starts."""
    register_schemas()
    run_app("config", parse_argv(argv), train_run, validate=to_run_config, outputs=output_dirs)


def output_dirs(cfg: DictConfig, run_dir: Optional[Path]) -> list[tuple[str, Path]]:
    """(setting, directory) for each directory a run of ``cfg`` (a composed ``config``) writes to besides its run
    dir's own files: the checkpoint root ``trainer.checkpoint_dir`` (default ``<run dir>/checkpoints``) and, with
    the Probe on, ``callbacks.probe.out_dir`` (default ``<run dir>/probe``). A default is left out when ``run_dir``
    is None (a sweep point, whose run dir Hydra numbers when it starts it)."""
    ckpt = OmegaConf.select(cfg, "trainer.checkpoint_dir")
    dirs = [("trainer.checkpoint_dir", checkpoint_root(ckpt, run_dir))] if ckpt or run_dir is not None else []
    probe_dir = probe_out_dir(OmegaConf.select(cfg, "callbacks.probe.out_dir"), run_dir)
    if OmegaConf.select(cfg, "callbacks.probe.enabled") and probe_dir is not None:
        dirs.append(("callbacks.probe.out_dir", probe_dir))
    return dirs


def script_main() -> NoReturn:
    """`main` as a process's entry point (``train.py``, ``python -m loka_trainer.train``, ``loka-train``): once
    `main` returned or raised SystemExit, atexit handlers run, stdout and stderr are flushed and the process ends
    with that exit status, skipping the interpreter's finalization; any other exception propagates as usual.

    NOTE: a gloo Work issued during backward (TorchRec's all-to-all, FSDP2's gradient reduce) keeps the Python
    context autograd stashes in thread-local state, and gloo's worker thread may drop it last; after finalization
    began, taking the GIL for that ends the thread inside a noexcept destructor (std::terminate: "terminate called
    without an active exception", exit -6 after ``done:``). The worker threads stop only when the ProcessGroup is
    freed, and references to it outlive `shutdown_distributed`.
    """
    try:
        main()
        status = 0
    except SystemExit as exc:
        status = exit_status(exc.code)
    end_process(status)


def exit_status(code: object) -> int:
    """The status Python exits with for ``SystemExit(code)``: None is 0, an int itself, anything else is printed to
    stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def end_process(status: int) -> NoReturn:
    """Run the atexit handlers (logging's flush among them), flush stdout and stderr, then end the process with
    ``status`` without the interpreter's finalization (`script_main` says why)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def train_run(cfg: DictConfig, run_dir: Path, argv: list[str], choices: dict[str, str]) -> None:
    """One run: ``cfg`` composed and resolved, ``argv`` its overrides (one sweep point's under ``-m``), ``choices``
    the option Hydra chose in each config group."""
    # every bad input fails here, before any process group or data
    run = typed_config(cfg, lambda composed: to_run_config(composed, choices))
    rank, world_size, _ = launch_env()
    ckpt_root = checkpoint_root(run.trainer.checkpoint_dir, run_dir)
    if (line := unwritable_line(output_dirs(cfg, run_dir))) is not None:  # the pre-flight knew no sweep point's dir
        fail(line)
    try:  # rank 0 holds it for the run: another run on this directory would write the same files
        lock = RunDirLock(run_dir) if rank == 0 else None  # noqa: F841 -- released when train_run returns
    except RunDirInUse as exc:
        fail(exc)
    try:
        start = plan_start(ckpt_root, resume=run.trainer.resume, world_size=world_size,
                           identity=model_identity(run.model, loka_mods=run.precision.mods,
                                                    dense_optimizer=run.trainer.dense_optimizer))
        complete = nothing_left(start, steps=run.trainer.steps, stop_after=run.trainer.stop_after,
                                finished=summary_steps(run_dir) == start.step)
    except CheckpointError as exc:
        fail(exc)
    if complete is not None:  # re-evaluating would append a record and overwrite summary.json's throughput
        if rank == 0:
            print(complete)
        return
    plan_note = precision_note = None
    if start.checkpoint is not None and run.precision.dispatch:
        run, plan_note = _with_resumed_plan(run, run_dir, start)
    if start.checkpoint is not None:
        _check_rank_states(run, start.checkpoint, world_size=world_size)
        precision_note = precision_change(start.precision, precision_identity(run.precision),
                                          checkpoint=start.checkpoint)
    notes = _set_aside_earlier_outputs(run, run_dir, ckpt_root) if rank == 0 and start.checkpoint is None else []
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir, rank=rank)
    logger = logging.getLogger("loka_trainer")
    for line in (start.warnings() if rank == 0 else []):
        logger.warning(line)
    for line in notes + ([note for note in (precision_note, plan_note) if note] if rank == 0 else []):
        logger.info(line)
    if start.checkpoint is None:
        write_run_config(run_dir, cfg, argv, rank=rank)
    dist_info = init_distributed(run.trainer.device)
    finished = False
    try:
        from loka_trainer.trainer import Trainer

        logger.info(f"run dir: {run_dir.resolve()}  (world size {dist_info.world_size}, device {dist_info.device})")
        trainer = Trainer(run, run_dir=run_dir, dist_info=dist_info)
        first_step = 0
        if start.checkpoint is not None:
            first_step = trainer.restore(start.checkpoint)
            for line in prepare_resumed_run(run_dir, ckpt_root, start, steps=run.trainer.steps) if rank == 0 else []:
                logger.info(line)
            write_run_config(run_dir, cfg, argv, rank=rank)
        trainer.fit(first_step)
        board = f", TensorBoard: tensorboard --logdir {run_dir.resolve() / 'tensorboard'}" \
            if run.callbacks.tensorboard else ""
        logger.info(f"done: metrics {run_dir.resolve() / METRICS_FILE}, summary {run_dir.resolve() / SUMMARY_FILE}"
                    f"{board}")
        finished = True
    except CheckpointError as exc:
        _stop(exc, status=2, rank=rank)
    except NonFiniteError as exc:
        _stop(exc, status=EXIT_NONFINITE, rank=rank)
    except RunStopped as exc:  # every rank saved the same step: a clean end
        logger.info(str(exc))
        finished = True
        raise SystemExit(exc.exit_status) from None
    finally:
        shutdown_distributed(wait_for_all=finished)  # after an error another rank may never reach a barrier


def _set_aside_earlier_outputs(run, run_dir: Path, ckpt_root: Path) -> list[str]:
    """A fresh start (rank 0): an earlier run's outputs in the run directory, and its Probe files in an explicit
    ``callbacks.probe.out_dir``, move to ``previous/`` (`resume`); the files this run reads are copied. Lines to log."""
    from loka_trainer.dispatch.probe_report import report_path

    inputs = [Path(run.precision.plan)] if run.precision.plan else []
    inputs += [report_path(run.precision.probe_stats)] if run.precision.probe_stats else []
    notes = set_aside_previous_run(run_dir, ckpt_root, inputs=inputs)
    probe = run.callbacks.probe
    if probe.enabled and probe.out_dir is not None:
        notes += set_aside_probe_outputs(Path(probe.out_dir), inputs=inputs)
    return notes


def _check_rank_states(run, checkpoint: Path, *, world_size: int) -> None:
    """One ``error:`` line and exit 2 on every rank, before anything is written (train.log included), when the
    saved state of any rank does not fit this run (`rank_state_mismatch`). Each rank checks every rank's file, so
    all reach the same verdict without a process group (none is started yet) and rank 0 prints the line even when
    only another rank's state is wrong."""
    for rank in range(world_size):
        if (mismatch := rank_state_mismatch(run, checkpoint, rank=rank, world_size=world_size)) is not None:
            fail(mismatch)


def rank_state_mismatch(run, checkpoint: Path, *, rank: int, world_size: int) -> Optional[str]:
    """One line when ``rank``'s saved state (its memory-mapped ``rankN.pt`` in ``checkpoint``) does not fit this
    run: a data position saved by a stream of other data settings (`data_position_mismatch`), or Probe statistics
    that do not fit ``callbacks.probe`` (`callbacks.probe.check_saved_state`); the line names the rank when there
    are several. None when it fits, or when the file cannot be mapped: the checkpoint's load names what is wrong
    then, and checks the data position again."""
    from loka_trainer.callbacks.probe import ProbeCallback, check_saved_state  # lazy: imports torch
    from loka_trainer.checkpoint import load_rank_state, rank_file

    try:
        saved = load_rank_state(rank_file(checkpoint, rank), mmap=True)
    except CheckpointError:
        return None
    whose = f"rank {rank}: " if world_size > 1 else ""
    if (mismatch := data_position_mismatch(run.data, saved.get("train_stream"), rank=rank,
                                           world_size=world_size)) is not None:
        return (f"{checkpoint} does not fit this run ({whose}{mismatch}); nothing was changed: resume with its data "
                f"settings, or set trainer.resume=false to start over")
    callbacks = saved.get("callbacks", {})
    try:
        if run.callbacks.probe.enabled and ProbeCallback.__name__ in callbacks:  # the callback's state_key
            check_saved_state(callbacks[ProbeCallback.__name__], run.callbacks.probe, rank=rank)
    except (KeyError, ValueError, TypeError) as exc:
        return (f"{checkpoint} does not fit this run ({whose}{type(exc).__name__}: {exc}); nothing was changed: "
                f"resume with its callbacks.probe settings, or set trainer.resume=false to start over")
    return None


def data_position_mismatch(data, position, *, rank: int, world_size: int) -> Optional[str]:
    """One line naming the first data setting (``data.*``: seed, batch size, Criteo file and byte range...) in which
    ``position`` (a checkpoint's saved train-stream state of ``rank``) differs from the train stream this run's
    ``data`` config builds; None when it fits, or when either cannot be told without building the stream (a
    position that is no dict, a Criteo file that cannot be read: the stream's own load names that)."""
    from loka_trainer.data.base import identity_mismatch
    from loka_trainer.data.stream import stream_identity  # lazy: imports torch

    if not isinstance(position, dict):
        return None
    try:
        identity = stream_identity(data, split="train", rank=rank, world_size=world_size)
    except (OSError, KeyError, ValueError):
        return None
    return identity_mismatch(identity, position)


def _with_resumed_plan(run, run_dir: Path, start: StartPlan):
    """(``run`` whose ``precision.plan`` is the plan file the resumed run must load, None where Dispatch measures
    one: the checkpoint was trained without it; a line to log); one ``error:`` line and exit 2 when it cannot
    resume with the plan it was trained with (`dispatch.reuse`)."""
    from loka_trainer.dispatch.reuse import resumed_plan_file  # lazy: imports torch and the kernels

    try:
        path, note = resumed_plan_file(run_dir, run.precision.plan, checkpoint=start.checkpoint,
                                       trained_with_dispatch=(start.precision or {}).get("dispatch"))
        resumed = dataclasses.replace(run, precision=dataclasses.replace(run.precision, plan=path))
        check_plan_file(resumed, build_small_model(resumed))  # a damaged or foreign plan, before any process group
    except ValueError as exc:
        fail(exc)
    return resumed, note


def _stop(exc: Exception, *, status: int, rank: int) -> None:
    """One ``error:`` line on stderr (rank 0; every rank meets the same error) and in train.log; exit `status`."""
    if rank == 0:
        line = f"error: {' '.join(str(exc).split())}"
        print(line, file=sys.stderr)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.stream.write(line + "\n")
                handler.flush()
    raise SystemExit(status)
