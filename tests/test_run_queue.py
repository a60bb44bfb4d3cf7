"""scripts/run_queue.py and scripts/train_runs.py: launching runs (ports, GPUs, recorded commands) and the queue
that starts them (order, concurrency, time budget, shared plans, runs reused from another study)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

from loka_trainer.dispatch.convert import PLAN_FILE
from scripts import quality_runs as qr
from scripts import run_queue
from scripts import train_runs
from scripts.run_queue import SUMMARY_KEYS

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_runs_get_the_port_they_are_given_and_ports_in_use_are_skipped():
    cmd = train_runs.torchrun_command(1, 41234)
    assert "--master_port=41234" in cmd and "--standalone" not in cmd and "--nproc_per_node=1" in cmd
    assert train_runs.run_env(41234, threads=3)["MASTER_PORT"] == "41234"
    first = train_runs.free_port(set())
    assert train_runs.free_port({first}) != first


def test_runs_spread_over_gpus_take_the_least_busy_group_of_nproc_devices(tmp_path, monkeypatch):
    assert run_queue.device_groups(8, 2) == ["0,1", "2,3", "4,5", "6,7"] and run_queue.device_groups(0, 1) == []
    assert run_queue.device_groups(3, 2) == ["0,1"]
    started = []
    fake = types.SimpleNamespace(Popen=lambda cmd, **kw: started.append(kw["env"]) or "proc", STDOUT=None)
    monkeypatch.setattr(run_queue, "subprocess", fake)  # run_queue's launches only (git_state keeps its own)
    launcher = run_queue.Launcher("python", 1, 1, gpus=2)
    jobs = [qr.Job("wukong", "bf16", s, tmp_path / "runs" / f"run{s}", []) for s in range(4)]
    for job in jobs[:3]:
        launcher.start(job)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in started] == ["0", "1", "0"]
    launcher.finish(jobs[1], 0)  # device 1 is free again, device 0 still runs two
    launcher.start(jobs[3])
    assert started[-1]["CUDA_VISIBLE_DEVICES"] == "1"
    record = json.loads((tmp_path / "runs" / "run1.launch.json").read_text())
    assert record["devices"] == "1"
    assert record["command"][:2] == ["python", "train.py"]  # recorded without this machine's directories
    started.clear()
    run_queue.Launcher("python", 1, 1).start(qr.Job("wukong", "bf16", 9, tmp_path / "runs" / "run9", []))
    assert started[0].get("CUDA_VISIBLE_DEVICES") == train_runs.os.environ.get("CUDA_VISIBLE_DEVICES")


def test_recorded_command_names_the_interpreter_and_repository_paths_portably(tmp_path):
    root = tmp_path / "repo"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"{root}/train.py", f"hydra.run.dir={root}/docs/r/run0",
           "hydra.run.dir=/elsewhere/run1", sys.executable]
    assert run_queue.portable_command(cmd, root) == [
        "python", "-m", "torch.distributed.run", "train.py", "hydra.run.dir=docs/r/run0",
        "hydra.run.dir=/elsewhere/run1", sys.executable]  # only the launched interpreter is renamed


# ---- scheduler ----------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


OUT_OF_MEMORY = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 136.00 MiB. GPU 0 has ...\n"


class FakeRun:
    """A run that ends after ``duration`` s of the fake clock; a plan-measuring one writes its plan after
    ``plan_after`` s (never when None). A failing one (``code`` != 0) ends its log with ``error``."""

    def __init__(self, job: qr.Job, clock: Clock, duration: float, plan_after, code: int = 0,
                 error: str = "ValueError: something else\n"):
        self.job, self.clock, self.end, self.code, self.error = job, clock, clock.t + duration, code, error
        self.plan_at = None if plan_after is None else clock.t + plan_after

    def poll(self):
        if self.plan_at is not None and self.clock.t >= self.plan_at:
            self.job.run_dir.mkdir(parents=True, exist_ok=True)
            (self.job.run_dir / PLAN_FILE).write_text("{}")
        if self.clock.t < self.end:
            return None
        if self.code == 0:
            self.job.run_dir.mkdir(parents=True, exist_ok=True)
            (self.job.run_dir / "summary.json").write_text(json.dumps(dict.fromkeys(SUMMARY_KEYS, 0.5)))
            (self.job.run_dir / "metrics.jsonl").write_text('{"step": 10, "loss": 0.5}\n')
        else:
            self.job.log_file.parent.mkdir(parents=True, exist_ok=True)
            self.job.log_file.write_text("step 1\n" + self.error)
        return self.code

    def terminate(self):
        self.end = self.clock.t


def _schedule(tmp_path, *, variants, seeds, concurrent, budget=None, share_plan=False, duration=10.0,
              plan_after=3.0, fail=(), out_of_memory=None):
    """Run fake jobs; returns (events [(t, 'start'|'end'|'end, again', name, running count)], not run, jobs).
    ``out_of_memory``: run name -> how many of its first starts end in torch's out-of-memory error."""
    clock, events, running, starts = Clock(), [], set(), {}
    jobs = qr.build_jobs(tmp_path, ["m"], variants, seeds, overrides=lambda m, v, s: [],
                         dispatch=lambda m, v: v == "loka", share_plan=share_plan)

    def start(job):
        running.add(job.name)
        starts[job.name] = starts.get(job.name, 0) + 1
        events.append((clock.t, "start", job.name, len(running)))
        oom = starts[job.name] <= (out_of_memory or {}).get(job.name, 0)
        return FakeRun(job, clock, duration, plan_after if job.builds_plan else None,
                       code=1 if job.name in fail or oom else 0, **({"error": OUT_OF_MEMORY} if oom else {}))

    def on_finish(job, code, again):
        running.discard(job.name)
        events.append((clock.t, "end, again" if again else "end", job.name, len(running)))

    not_run = qr.run_jobs(qr.start_order(jobs), concurrent=concurrent, budget_s=budget, start=start,
                          on_finish=on_finish, log=lambda _: None, clock=clock, sleep=clock.sleep)
    return events, not_run, jobs


def test_runs_start_in_order_up_to_k_at_once(tmp_path):
    events, not_run, jobs = _schedule(tmp_path, variants=["bf16", "bf16_mods"], seeds=[0, 1, 2], concurrent=2)
    starts = [e for e in events if e[1] == "start"]
    assert [e[2] for e in starts] == [j.name for j in jobs] and not not_run
    assert max(e[3] for e in events) == 2 and starts[0][0] == starts[1][0] == 0.0  # two at once from the start
    assert all(j.finished() for j in jobs)


def test_no_run_starts_after_the_time_budget_and_running_ones_finish(tmp_path):
    events, not_run, jobs = _schedule(tmp_path, variants=["bf16"], seeds=[0, 1, 2, 3], concurrent=2, budget=5.0)
    assert [e[2] for e in events if e[1] == "start"] == ["m_bf16_seed0", "m_bf16_seed1"]
    assert [e[2] for e in events if e[1] == "end"] == ["m_bf16_seed0", "m_bf16_seed1"]  # not killed at the budget
    assert [(j.name, why.split(":")[0]) for j, why in not_run] == [("m_bf16_seed2", "not started"),
                                                                    ("m_bf16_seed3", "not started")]


def test_shared_plan_is_measured_alone_then_loaded_by_the_other_seeds(tmp_path):
    events, not_run, jobs = _schedule(tmp_path, variants=["bf16", "loka"], seeds=[0, 1], concurrent=4,
                                      share_plan=True, plan_after=3.0)
    starts = [e for e in events if e[1] == "start"]
    assert starts[0][2] == "m_loka_seed0" and starts[1][0] >= 3.0  # nothing else while the plan is measured
    assert not not_run and (tmp_path / "plans" / "m_loka.json").is_file()
    loka1 = next(j for j in jobs if j.name == "m_loka_seed1")
    assert loka1.command_overrides()[-1] == f"precision.plan={(tmp_path / 'plans' / 'm_loka.json').resolve()}"
    bf16 = next(j for j in jobs if j.name == "m_bf16_seed0")
    assert bf16.shared_plan is None and bf16.command_overrides() == []


def test_seeds_waiting_for_a_plan_that_never_came_are_reported_not_hung(tmp_path):
    events, not_run, _ = _schedule(tmp_path, variants=["bf16", "loka"], seeds=[0, 1], concurrent=2,
                                   share_plan=True, plan_after=None, fail={"m_loka_seed0"})
    assert [j.name for j, _ in not_run] == ["m_loka_seed1"] and "no shared plan" in not_run[0][1]
    assert {e[2] for e in events if e[1] == "end"} == {"m_loka_seed0", "m_bf16_seed0", "m_bf16_seed1"}


def test_a_plan_left_by_an_earlier_call_is_adopted_so_no_run_measures_again(tmp_path):
    jobs = qr.build_jobs(tmp_path, ["m"], ["loka"], [0, 1], overrides=lambda m, v, s: [],
                         dispatch=lambda m, v: True, share_plan=True)
    jobs[0].run_dir.mkdir(parents=True)
    (jobs[0].run_dir / PLAN_FILE).write_text('{"layers": {}}')
    assert "measured by m_loka_seed0" in qr.adopt_plan(jobs[0])
    assert not jobs[0].measuring() and jobs[0].command_overrides()[-1].startswith("precision.plan=")
    assert qr.adopt_plan(jobs[0]) is None  # adopted once: a later file is not copied over it


def test_reuse_from_copies_a_shared_plan_the_study_lacks_but_not_the_runs_that_measured_it(tmp_path):
    published = ROOT / "docs" / "results" / "quality_interformer_h200_warmup"
    jobs = qr.build_jobs(tmp_path, ["interformer_h200"], ["bf16", "loka"], [1, 0], overrides=lambda m, v, s: [],
                         dispatch=lambda m, v: v == "loka", share_plan=True)
    lines = qr.reuse_from(jobs, tmp_path, published, ["bf16"])
    plan = "plans/interformer_h200_loka.json"
    assert (tmp_path / plan).read_bytes() == (published / plan).read_bytes() and len(lines) == 3
    loka = [j for j in jobs if j.variant == "loka"]
    assert not any(j.finished() for j in loka) and not any(j.measuring() for j in loka)  # both load the plan


def test_a_run_out_of_device_memory_beside_others_starts_again_alone_and_finishes(tmp_path):
    events, not_run, jobs = _schedule(tmp_path, variants=["bf16"], seeds=[0, 1, 2], concurrent=2,
                                      out_of_memory={"m_bf16_seed0": 1})
    assert [(t, kind, name) for t, kind, name, _ in events] == [
        (0.0, "start", "m_bf16_seed0"), (0.0, "start", "m_bf16_seed1"),
        (10.0, "end, again", "m_bf16_seed0"), (10.0, "end", "m_bf16_seed1"),
        (10.0, "start", "m_bf16_seed0"),  # alone: seed 2 waits for it although two may run at once
        (20.0, "end", "m_bf16_seed0"), (20.0, "start", "m_bf16_seed2"), (30.0, "end", "m_bf16_seed2")]
    assert not not_run and all(j.finished() for j in jobs)


def test_a_run_is_started_again_only_after_running_out_of_memory_beside_others_and_only_once(tmp_path):
    events, _, jobs = _schedule(tmp_path / "alone", variants=["bf16"], seeds=[0, 1], concurrent=1,
                                out_of_memory={"m_bf16_seed0": 1})  # it had the device to itself: no help
    assert [e[1:3] for e in events if e[2] == "m_bf16_seed0"] == [("start", "m_bf16_seed0"), ("end", "m_bf16_seed0")]
    events, _, jobs = _schedule(tmp_path / "other", variants=["bf16"], seeds=[0, 1], concurrent=2,
                                fail={"m_bf16_seed0"})  # another error: running alone would not help
    assert [e[1] for e in events if e[2] == "m_bf16_seed0"] == ["start", "end"]
    events, _, jobs = _schedule(tmp_path / "twice", variants=["bf16"], seeds=[0, 1], concurrent=2,
                                out_of_memory={"m_bf16_seed0": 2})
    assert [e[1] for e in events if e[2] == "m_bf16_seed0"] == ["start", "end, again", "start", "end"]
    assert not jobs[0].finished() and jobs[1].finished()


def test_a_run_waiting_to_start_again_when_the_budget_is_spent_says_it_ran_out_of_memory(tmp_path):
    _, not_run, _ = _schedule(tmp_path, variants=["bf16"], seeds=[0, 1, 2], concurrent=2, budget=5.0,
                              out_of_memory={"m_bf16_seed0": 1})
    assert dict((j.name, why) for j, why in not_run) == {
        "m_bf16_seed0": "ran out of device memory beside other runs; not started again: time budget 5 s spent",
        "m_bf16_seed2": "not started: time budget 5 s spent"}


def test_out_of_memory_is_read_from_the_end_of_a_runs_log(tmp_path):
    log = tmp_path / "run.log"
    assert not run_queue.ran_out_of_device_memory(log)  # no log: not a memory error
    log.write_text("x" * 100_000 + "Traceback ...\n" + OUT_OF_MEMORY)
    assert run_queue.ran_out_of_device_memory(log)
    log.write_text("Traceback ...\n" + OUT_OF_MEMORY.replace("OutOfMemoryError: CUDA out of memory", "ValueError"))
    assert not run_queue.ran_out_of_device_memory(log)
