"""Many train.py runs on one machine: a queue that starts up to K at once, each on its own port, and lets the runs
of a Dispatch precision share one plan, measured by the first of them while nothing else uses the device.

A ``Job`` is one run (its run dir and train.py overrides); ``run_jobs`` starts them in ``start_order`` as
``readiness`` allows, within a time budget; ``Launcher`` starts one as a child process (output in
``<run dir>.log``, exit status, port and wall time in ``<run dir>.launch.json``). A run that ran out of device
memory while others shared the device (``ran_out_of_device_memory``) starts again once, alone.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable, Collection, Optional, Protocol, Sequence

from loka_trainer.atomic_files import atomic_copy
from loka_trainer.dispatch.convert import PLAN_FILE
from scripts.provenance import git_state, source_digest
from scripts.result_files import json_object
from scripts.train_runs import LAUNCHERS, ROOT, free_port, run_env


@dataclasses.dataclass
class Job:
    """One (model, precision variant, seed) run. ``shared_plan``: its Dispatch plan file under --share-plan;
    ``builds_plan``: this run measures that plan (the first seed), the others load it. ``alone``: it ran out of
    device memory beside other runs and starts again with the device to itself."""

    model: str
    variant: str
    seed: int
    run_dir: Path
    overrides: list[str]
    shared_plan: Optional[Path] = None
    builds_plan: bool = False
    alone: bool = False

    @property
    def name(self) -> str:
        return self.run_dir.name

    def finished(self) -> bool:
        return record_problem(self.run_dir) is None

    def measuring(self) -> bool:
        """True while this run still has to measure the shared plan (nothing else may use the device then)."""
        return self.builds_plan and not self.shared_plan.is_file()

    def needs_device_alone(self) -> bool:
        """While measuring the shared plan (timings), or started again after running out of device memory."""
        return self.alone or self.measuring()

    @property
    def log_file(self) -> Path:
        """The run's output, ``<run dir>.log``."""
        return self.run_dir.with_suffix(".log")

    def command_overrides(self) -> list[str]:
        """train.py's overrides; a run that loads the shared plan gets `precision.plan` (once the plan exists)."""
        if self.shared_plan is None or not self.shared_plan.is_file():
            return list(self.overrides)
        return [*self.overrides, f"precision.plan={self.shared_plan.resolve()}"]


SUMMARY_KEYS = ("eval_logloss", "eval_ne", "eval_auc", "examples_per_s")  # what a study reads from summary.json


def record_problem(run_dir: Path) -> Optional[str]:
    """None when ``run_dir`` holds a finished run's readable records (``summary.json`` with ``SUMMARY_KEYS``, every
    line of ``metrics.jsonl`` JSON); else what is missing or damaged, in a few words. A damaged run is not finished
    and runs again: train.py moves its outputs aside, nothing is deleted."""
    summary, metrics = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not summary.is_file():
        return "no summary.json"
    if (why := json_object(summary, SUMMARY_KEYS)[1]) is not None:
        return f"summary.json is damaged ({why})"
    try:
        lines = metrics.read_text().splitlines()
    except OSError as exc:
        return f"metrics.jsonl is unreadable ({exc})"
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except ValueError as exc:
            return f"metrics.jsonl line {number} is damaged ({exc})"
    return None


# overrides that change where or how visibly a run trains, not what it trains: its output directory (and Hydra's
# other settings), the progress bar, TensorBoard logs, checkpoints written along the way
LAUNCH_ONLY = ("hydra", "callbacks.progress", "callbacks.tensorboard", "trainer.checkpoint_at_end",
               "trainer.checkpoint_interval")


def recorded_overrides(run_dir: Path) -> Optional[list[str]]:
    """train.py's overrides as ``<run dir>.launch.json`` recorded them (its ``command`` after ``train.py``); None
    where there is no readable record of a train.py command."""
    launch, _ = json_object(run_dir.with_suffix(".launch.json"), ("command",))
    command = launch["command"] if launch is not None else None
    if not isinstance(command, list):
        return None
    at = next((i for i, arg in enumerate(command) if str(arg).endswith("train.py")), None)
    return None if at is None else [str(arg) for arg in command[at + 1:]]


def override_map(overrides: Sequence[str]) -> dict[str, Optional[str]]:
    """Hydra overrides -> {key: value}, the last of a key winning as in Hydra; ``+``/``++`` dropped from the key,
    the repository's path dropped from a value (``.launch.json`` records paths relative to it); an item without
    ``=`` maps to None."""
    result: dict[str, Optional[str]] = {}
    for item in overrides:
        key, eq, value = item.partition("=")
        result[key.lstrip("+")] = value.replace(f"{ROOT}/", "") if eq else None
    return result


def launch_only(key: str) -> bool:
    """Whether the override ``key`` is one of ``LAUNCH_ONLY`` (or below one)."""
    return any(key == k or key.startswith(f"{k}.") for k in LAUNCH_ONLY)


def override_differences(recorded: Sequence[str], wanted: Sequence[str], *,
                         unread: Collection[str] = ()) -> list[str]:
    """How ``wanted`` (the overrides a command would launch a run with) differs from ``recorded`` (those it was
    trained with), one phrase per key in key order: ``k=v (recorded k=u)``, ``k=v (not recorded)``, ``k=u (recorded,
    not in this command)``. ``launch_only`` keys and the keys in ``unread`` (settings the run does not read, e.g.
    ``precision.exclude`` of a BF16 run) are not compared."""
    old, new = override_map(recorded), override_map(wanted)
    phrases = []
    for key in sorted(old.keys() | new.keys()):
        if launch_only(key) or key in unread or old.get(key, ...) == new.get(key, ...):
            continue
        if key not in old:
            phrases.append(f"{key}={new[key]} (not recorded)")
        elif key not in new:
            phrases.append(f"{key}={old[key]} (recorded, not in this command)")
        else:
            phrases.append(f"{key}={new[key]} (recorded {key}={old[key]})")
    return phrases


def job_differences(job: Job, run_dir: Path, unread: Collection[str] = ()) -> list[str]:
    """``override_differences`` between the train.py overrides recorded in ``<run_dir>.launch.json`` and ``job``'s
    (none where no train.py command is recorded). The study's shared plan is not compared: a run that loaded it
    (`precision.plan=.../plans/<its file name>`) trains the layers of the run that measured it."""
    recorded = recorded_overrides(run_dir)
    if recorded is None:
        return []
    if job.shared_plan is not None:
        shared = f"plans/{job.shared_plan.name}"
        recorded = [o for o in recorded if not (o.startswith("precision.plan=") and o.endswith(shared))]
    return override_differences(recorded, job.overrides, unread=unread)


def start_order(jobs: list[Job]) -> list[Job]:
    """``jobs`` in the order to start them: model by model, its plan-measuring runs first (they need the device to
    themselves, ``readiness``; the others of their variant wait for their plan)."""
    models = list(dict.fromkeys(j.model for j in jobs))
    return [j for m in models for first in (True, False) for j in jobs if j.model == m and j.builds_plan == first]


def adopt_plan(job: Job) -> Optional[str]:
    """A plan-measuring run's `dispatch_plan.json` becomes the shared plan (copied atomically) once it exists;
    returns a line to print when it did."""
    src = job.run_dir / PLAN_FILE
    if not job.builds_plan or job.shared_plan.is_file() or not src.is_file():
        return None
    atomic_copy(src, job.shared_plan)
    return f"shared plan {job.shared_plan} (measured by {job.name})"


def reuse_from(jobs: list[Job], out: Path, source: Path, variants: Sequence[str],
               differs: Callable[[Job, Path], list[str]] = lambda job, src: []) -> list[str]:
    """Start a study from another one's records: each finished run of ``variants`` under the study folder ``source``
    (same run name) is copied into ``out`` where the job has not finished, with its ``.launch.json`` and ``.log``
    (they keep its own command and commit), and so is each shared plan ``out`` lacks. A run for which
    ``differs(job, its run dir in source)`` names differences (the job's overrides against its record's) is not
    copied. Returns a line per copy and per run left out."""
    lines = []
    for job in jobs:
        src = source / job.run_dir.relative_to(out)
        reusable = job.variant in variants and not job.finished() and record_problem(src) is None
        if reusable and (found := differs(job, src)):
            lines.append(f"{job.name}: not reused from {source}: trained with other overrides ({'; '.join(found)})")
        elif reusable:
            shutil.copytree(src, job.run_dir, dirs_exist_ok=True)
            for suffix in (".launch.json", ".log"):
                if src.with_suffix(suffix).is_file():
                    shutil.copyfile(src.with_suffix(suffix), job.run_dir.with_suffix(suffix))
            lines.append(f"reused {job.name} from {source}")
        plan = job.shared_plan
        if plan is not None and not plan.is_file() and (source / plan.relative_to(out)).is_file():
            plan.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / plan.relative_to(out), plan)
            lines.append(f"shared plan {plan} from {source}")
    return lines


WAIT = "wait"


OUT_OF_MEMORY_LINES = ("torch.OutOfMemoryError", "CUDA out of memory")  # what torch prints when the device is full


def ran_out_of_device_memory(log: Path, *, tail_bytes: int = 65536) -> bool:
    """Whether a run's output (its ``<run dir>.log``) ends in torch's out-of-memory error (the last
    ``tail_bytes``, where a traceback lands)."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(line in tail for line in OUT_OF_MEMORY_LINES)


def readiness(job: Job, running: list[Job], active: list[Job]) -> Optional[str]:
    """None: ``job`` may start now; ``WAIT``: not yet; any other string: it cannot run, and why.
    ``running``: the jobs running now; ``active``: the jobs still pending or running."""
    if any(r.needs_device_alone() for r in running):
        return WAIT  # a plan is being measured (its timings) or a run needs all the device memory
    if job.needs_device_alone():
        return WAIT if running else None
    if job.shared_plan is not None and not job.shared_plan.is_file():
        if any(j.builds_plan and j.shared_plan == job.shared_plan for j in active):
            return WAIT
        return f"not run: no shared plan {job.shared_plan} (the run measuring it ended without writing one)"
    return None


def budget_spent(job: Job, budget_s: float) -> str:
    """Why ``job`` did not run: the time budget was spent before it started (again, for a run that ran out of
    device memory beside others)."""
    if job.alone:
        return f"ran out of device memory beside other runs; not started again: time budget {budget_s:g} s spent"
    return f"not started: time budget {budget_s:g} s spent"


class Process(Protocol):
    def poll(self) -> Optional[int]: ...


def run_jobs(jobs: list[Job], *, concurrent: int, budget_s: Optional[float], start: Callable[[Job], Process],
             on_finish: Callable[[Job, int, bool], None],
             out_of_memory: Callable[[Job], bool] = lambda job: ran_out_of_device_memory(job.log_file),
             log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep, poll_s: float = 1.0) -> list[tuple[Job, str]]:
    """Start ``jobs`` in order, up to ``concurrent`` at a time, none after ``budget_s`` seconds (running ones
    finish); ``on_finish(job, returncode, again)`` after each, ``again`` True where the run failed
    ``out_of_memory`` while another one ran (on any device: runs spread over GPUs count too): it goes back to the
    front of the queue, ``alone``, once. Returns the jobs that did not run, with the reason."""
    t0, pending, running, not_run, shared = clock(), list(jobs), [], [], set()
    try:
        while pending or running:
            for job, proc in list(running):
                code = proc.poll()  # before adopting: a run that has ended wrote its plan already
                line = adopt_plan(job)
                if line:
                    log(line)
                if code is not None:
                    running.remove((job, proc))
                    again = code != 0 and not job.alone and job.name in shared and out_of_memory(job)
                    on_finish(job, code, again)
                    if again:
                        job.alone = True
                        pending.insert(0, job)
                        log(f"{job.name} ran out of device memory beside other runs: it starts again alone")
            if pending and budget_s is not None and clock() - t0 >= budget_s:
                not_run += [(j, budget_spent(j, budget_s)) for j in pending]
                pending = []
            while pending and len(running) < concurrent:
                now = [j for j, _ in running]
                verdict = readiness(pending[0], now, pending + now)
                if verdict == WAIT:
                    if not running:
                        raise RuntimeError(f"{pending[0].name} waits with nothing running (job order)")
                    break
                job = pending.pop(0)
                if verdict is not None:
                    not_run.append((job, verdict))
                    continue
                running.append((job, start(job)))
            if len(running) > 1:
                shared.update(j.name for j, _ in running)
            if running:
                sleep(poll_s)
    finally:
        for _, proc in running:  # interrupted: stop the runs this call started
            if proc.poll() is None:
                proc.terminate()
    return not_run


def device_groups(gpus: int, nproc: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value of each slot a run can take: ``gpus // nproc`` groups of ``nproc``
    consecutive devices (``device_groups(8, 2)`` -> ``["0,1", "2,3", "4,5", "6,7"]``); none for ``gpus=0``."""
    return [",".join(str(d) for d in range(g * nproc, (g + 1) * nproc)) for g in range(gpus // nproc)]


def least_loaded(groups: list[str], busy: list[str]) -> str:
    """The group with the fewest running runs (``busy``: the group of each), the first of those on a tie."""
    return min(groups, key=busy.count)


@dataclasses.dataclass
class Launched:
    proc: subprocess.Popen
    log: IO[str]
    port: int
    command: list[str]
    t0: float
    devices: Optional[str] = None


def portable_command(cmd: list[str], root: Path) -> list[str]:
    """`cmd` as recorded in ``.launch.json``: the interpreter as ``python`` and paths under `root` relative to it, so
    a committed record names no machine's directories (the run itself used `cmd` as is, from `root`)."""
    prefix = f"{root}/"
    return ["python" if i == 0 and arg == sys.executable else arg.replace(prefix, "") for i, arg in enumerate(cmd)]


class Launcher:
    """Starts a job as a child process (its output in ``<run dir>.log``) and records its exit status, wall time,
    devices and the checkout it ran (``commit``, ``dirty``: ``scripts.provenance.git_state``; ``source``: the code's
    digest, ``scripts.provenance.source_digest``; read once when the launcher is made: the study's own tracked
    outputs, rewritten after each run, must not mark later runs dirty) in ``<run dir>.launch.json`` when it ends.
    With ``gpus`` > 0 each run sees only its own ``nproc`` of them (``CUDA_VISIBLE_DEVICES``), the group with the
    fewest runs at its start; with 0 every run sees every device."""

    def __init__(self, launcher: str, nproc: int, threads: int, gpus: int = 0):
        self.command, self.nproc, self.threads = LAUNCHERS[launcher], nproc, threads
        self.groups = device_groups(gpus, nproc)
        self.checkout = {**dict(zip(("commit", "dirty"), git_state())), "source": source_digest()}
        self.live: dict[str, Launched] = {}

    def start(self, job: Job) -> subprocess.Popen:
        port = free_port({r.port for r in self.live.values()})
        devices = least_loaded(self.groups, [r.devices for r in self.live.values()]) if self.groups else None
        cmd = [*self.command(self.nproc, port), *job.command_overrides()]
        job.run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = job.log_file.open("w")
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=run_env(port, threads=self.threads, devices=devices))
        self.live[job.name] = Launched(proc, log, port, cmd, time.perf_counter(), devices)
        print(f"started {job.name} (port {port}{f', devices {devices}' if devices else ''})", flush=True)
        return proc

    def finish(self, job: Job, code: int) -> None:
        run = self.live.pop(job.name)
        run.log.close()
        wall = time.perf_counter() - run.t0
        job.run_dir.with_suffix(".launch.json").write_text(json.dumps(
            {"command": portable_command(run.command, ROOT), "port": run.port, "devices": run.devices,
             "returncode": code, "wall_s": wall,
             **self.checkout}, indent=1) + "\n")
        state = "finished" if code == 0 and job.finished() else f"FAILED (exit {code})"
        print(f"{state}: {job.name} in {wall:.0f} s (log {job.log_file})", flush=True)
