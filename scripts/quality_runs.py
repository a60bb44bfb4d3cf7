"""Quality runs for the evidence report: every (model, precision, seed) trained on the same planted-teacher data.

    python -m scripts.quality_runs --out docs/results/quality_cpu --steps 300 --seeds 0 1 2 \
        --models wukong interformer --precisions bf16 bf16_mods fp8_tensorwise fp8_rowwise loka [-- extra overrides]

Each run is one train.py job: `model=M`, the precision's overrides (``PRECISION_VARIANTS``, else the preset
`precision=P`), `trainer.seed=S`, with the data seed fixed, so runs of one seed see identical batches and their
train losses are comparable window by window. `--launcher python` starts `python train.py` (one process, `--nproc
1`), `--launcher torchrun` starts `torchrun --nproc_per_node=N` on its own rendezvous port; either way every run
gets its own MASTER_PORT, so `--concurrent K` runs up to K of them at once (they share the device).
`--time-budget S` starts no run later than S seconds after the first one started (running ones finish): the
queue is `scripts.run_queue`. A run that ran out of GPU memory while others shared the device starts again, once,
alone (the others first finish; nothing else starts while it runs). `--gpus G` spreads the runs over G GPUs: each
run sees only its own `--nproc` of them (`CUDA_VISIBLE_DEVICES`), the group with the fewest runs when it starts;
`--concurrent` still caps the total (on 8 GPUs, `--gpus 8 --concurrent 8` trains eight one-GPU runs at once).
`--eval-interval N` evaluates every N steps (the eval log loss curve). After every finished run
`<out>/quality.json` (per run: the train-loss trajectory, the eval curve and the final eval metrics; the table adds
the relative log loss (RLL) vs the BF16 run of the same seed, the BF16 seed-to-seed noise floor and LoKA vs
BF16+Mods) and the plots (`scripts.plot_results`) are rewritten, so a call cut short still leaves a usable partial
table. Runs already finished under `<out>/runs/` are reused; a run's output is `<out>/runs/<name>.log`, its exit
status, port and wall time `<out>/runs/<name>.launch.json`. A finished run's record (`summary.json`,
`metrics.jsonl`, the `.launch.json`) is all this script reads back, and git tracks it (the rest of a run directory
is ignored): committed, a study spread over several machines or checkouts goes on where it stopped. `--no-run`
starts nothing and rewrites `quality.json` and the plots from the finished records of the selection (say, after
records came from another machine, or a call that ran a subset of the precisions wrote a table of that subset).
It only redraws: `quality.json` keeps the metadata of the call that trained the study (`command`, `steps`,
`extra_overrides`, ...: those of the `quality.json` it replaces) and adds `redrawn_by`, the `--no-run` command line;
where no `quality.json` with a `command` is there, the metadata are the `--no-run` call's, as for a call that trains.

A `quality.json` there that holds runs whose records are not under `runs/` (a study published before records were
kept) stops the call in one `error:` line, the file left as it is: a table written now would lose them.

A finished run is reused only where the train.py overrides its `.launch.json` records are those this command would
launch it with. Any other difference (another `--steps` or `--eval-interval`, another override after `--`) prints
one line per such run naming the differing overrides, then one `error:` line, exit 2, before any run starts or
`quality.json` is written (training it again would overwrite a good record): give the command the runs were trained
with, or `--accept-recorded` to count them as recorded (each then carries its `differs_from_command` in
`quality.json`). A run whose `.launch.json` records no train.py command is not compared.
Not compared: overrides that change where a run trains, not what (`run_queue.LAUNCH_ONLY`: the run directory, the
progress bar, TensorBoard, checkpoints; the launcher and its port are no overrides), precision settings the run does
not read (`train_runs.unread_precision_fields`: `precision.exclude` of a BF16 run), and under `--share-plan` the
study's shared plan (`precision.plan=.../plans/<model>_<precision>.json`) that a run loaded.

`--reuse-from DIR` starts from another study's records: its finished runs of `--reuse` (default bf16 bf16_mods) and
its shared plans are copied in first, so a study that changes only LoKA (say `precision.exclude`) trains only LoKA.
A run of DIR trained with other overrides than this command's (compared as above, so not for a BF16 run's missing
`precision.exclude`) is not copied, with a line saying so; `--accept-recorded` copies it.

`--share-plan`: the runs of a Dispatch precision (loka) share one plan, `<out>/plans/<model>_<precision>.json`,
measured by the first seed's run while no other run uses the device (concurrent runs would skew its timings);
the other seeds load it (`precision.plan`) and start once it exists. All seeds then train the same FP8 layers.

How long: BF16 wukong_h200's eval log loss flattens after ~2000 steps at batch 8192 (one H200, 2026-12-02,
docs/results/quality_h200_bf16_curve/), where a run trains at ~110k examples/s, so each run is ~3 minutes of
training plus ~40 s of start-up and compilation (LoKA builds its plan first: ~130 s with one timing round). Runs
on one GPU share its time, so 5 precisions x 3 seeds take ~55 minutes however many run at once (an estimate from
those speeds; two runs at once took 400-510 s together, docs/results/quality_h200/). `--time-budget` cuts it into
parts; the same command again goes on where it stopped:

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m scripts.quality_runs --out OUT --models wukong_h200 \
        --precisions bf16 bf16_mods fp8_tensorwise fp8_rowwise loka --seeds 0 1 2 --steps 2400 --eval-interval 200 \
        --nproc 1 --concurrent 3 --share-plan -- trainer.device=cuda trainer.compile=true \
        data.batch_size=8192 data.eval_batches=12 precision.timing_rounds=1
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Optional

from loka_trainer.arg_types import writable_dir
from scripts.plot_results import plot_quality, plot_quality_curves, quality_table
from scripts.result_files import previous_result
from scripts.run_queue import (Job, Launcher, adopt_plan, job_differences, record_problem, reuse_from, run_jobs,
                               start_order)
from scripts.train_runs import (LAUNCHERS, PRECISION_VARIANTS, checked_run_configs, composed_precisions,
                                composed_unread_precision, known_variants, precision_overrides)


def run_overrides(out: Path, model: str, variant: str, seed: int, *, steps: int, eval_interval: int,
                  extra: list[str]) -> list[str]:
    """train.py's overrides for one run (no checkpoints: a rerun of this script reuses finished runs instead)."""
    return [f"model={model}", *precision_overrides(variant), f"trainer.seed={seed}", f"trainer.steps={steps}",
            f"trainer.eval_interval={eval_interval}", "trainer.resume=false", "trainer.checkpoint_at_end=false",
            "callbacks.progress=false", f"hydra.run.dir={run_dir(out, model, variant, seed)}", *extra]


def run_dir(out: Path, model: str, variant: str, seed: int) -> Path:
    return out / "runs" / f"{model}_{variant}_seed{seed}"


def build_jobs(out: Path, models: list[str], variants: list[str], seeds: list[int], *,
               overrides: Callable[[str, str, int], list[str]], dispatch: Callable[[str, str], bool],
               share_plan: bool) -> list[Job]:
    """Every run, per model, seed by seed, every variant (the table's order). Under ``share_plan`` the runs of a
    Dispatch variant (``dispatch(model, variant)``) share one plan, measured by the first seed's run."""
    jobs = []
    for m in models:
        for s in seeds:
            for v in variants:
                job = Job(m, v, s, run_dir(out, m, v, s), overrides(m, v, s))
                if share_plan and dispatch(m, v):
                    job.shared_plan = out / "plans" / f"{m}_{v}.json"
                    job.builds_plan = s == seeds[0]
                jobs.append(job)
    return jobs


PROVENANCE_FIELDS = ("device", "torch", "finished")  # summary.json's, where the run wrote them


def eval_curve(records: list[dict]) -> list[list[float]]:
    """[[step, eval log loss], ...] of a run's metrics.jsonl records, in logged order."""
    return [[r["step"], r["eval_logloss"]] for r in records if "eval_logloss" in r]


def read_run(job: Job) -> dict:
    """A finished run's record in quality.json (train-loss trajectory, eval curve, final eval, throughput, and where
    it ran: device, torch, finish time, commit, code digest; runs written before those fields existed lack them)."""
    records = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    record = {"model": job.model, "precision": job.variant, "seed": job.seed,
              "train": [[r["step"], r["loss"]] for r in records if "loss" in r],
              "eval_curve": eval_curve(records),
              "eval": {k: summary[k] for k in ("eval_logloss", "eval_ne", "eval_auc")},
              "examples_per_s": summary["examples_per_s"]}
    record.update({k: summary[k] for k in PROVENANCE_FIELDS if k in summary})
    launch = job.run_dir.with_suffix(".launch.json")
    if launch.is_file():
        launched = json.loads(launch.read_text())
        record.update({k: launched[k] for k in ("wall_s", "commit", "dirty", "source") if k in launched})
    return record


def unfinished_run(job: Job) -> Optional[dict]:
    """A run that stopped before its end (no readable ``summary.json``: its time ran out, it was stopped, or it is
    still running) but logged evaluations: model, precision, seed, its last logged step and the eval curve so far,
    for the curve plot (the table needs final metrics). None when it logged none. Lines that are not JSON (the
    last one of a process killed while writing it) are skipped."""
    records = []
    try:
        lines = (job.run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    records = [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), int)]
    curve = eval_curve(records)
    if not curve:
        return None
    return {"model": job.model, "precision": job.variant, "seed": job.seed,
            "last_step": max(r["step"] for r in records), "eval_curve": curve}


def unrecorded_runs(previous: Optional[dict], out: Path) -> list[str]:
    """The runs a quality.json written earlier (``previous``) holds whose records are not under ``out/runs/`` (a
    study published before the records were kept, or records lost): a table written now would drop them for good."""
    runs = previous.get("runs", []) if previous is not None else []
    names = [f"{r['model']}_{r['precision']}_seed{r['seed']}" for r in runs
             if isinstance(r, dict) and {"model", "precision", "seed"} <= r.keys()]
    return [n for n in names if record_problem(out / "runs" / n) is not None]


def recorded_differences() -> Callable[[Job, Path], list[str]]:
    """``differs(job, run_dir)``: how the overrides of the run recorded in ``run_dir`` differ from ``job``'s
    (``run_queue.job_differences``), leaving out the precision settings the job's (model, precision) does not read
    (``train_runs.unread_precision_fields``: e.g. ``precision.exclude`` of a BF16 run; its config is composed once,
    where a record differs at all)."""
    unread: dict[tuple[str, str], set[str]] = {}

    def differs(job: Job, run_dir: Path) -> list[str]:
        pair = (job.model, job.variant)
        if pair not in unread and job_differences(job, run_dir):
            unread[pair] = {f"precision.{f}" for f in composed_unread_precision(job.overrides)}
        return job_differences(job, run_dir, unread[pair]) if pair in unread else []

    return differs


def redraw_meta(previous: Optional[dict], meta: dict, command: str) -> dict:
    """``--no-run``'s metadata in quality.json: where the quality.json it replaces (``previous``) names the command
    that trained the study, that call's metadata (each key of ``meta`` it has; the precisions it lacks from
    ``meta``) and ``redrawn_by``: ``command`` (this call's); else ``meta``."""
    if previous is None or "command" not in previous:
        return meta
    kept = {k: previous.get(k, v) for k, v in meta.items()}
    recorded = previous.get("precision_overrides")
    kept["precision_overrides"] = {**meta["precision_overrides"], **(recorded if isinstance(recorded, dict) else {})}
    return {**kept, "redrawn_by": command}


def write_results(out: Path, meta: dict, jobs: list[Job], not_run: list[tuple[Job, str]],
                  differing: Optional[dict[str, list[str]]] = None) -> tuple[dict, list[Path]]:
    """quality.json (atomically) and the plots from every finished run so far; a run counted although trained with
    other overrides (``differing``: run name -> the differences, ``--accept-recorded``) carries them as
    ``differs_from_command``; a run that logged evaluations but did not finish is in ``unfinished``
    (``unfinished_run``: its curve is drawn, nothing of it is in the table). Returns (result, plot files)."""
    differing = differing or {}
    finished = [j.finished() for j in jobs]  # reads each run's records once
    result = {**meta, "runs": [{**read_run(j), **({"differs_from_command": differing[j.name]}
                                                  if j.name in differing else {})}
                               for j, done in zip(jobs, finished) if done],
              "unfinished": [u for j, done in zip(jobs, finished) if not done and (u := unfinished_run(j)) is not None],
              "not_run": [{"run": j.name, "why": why} for j, why in not_run]}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "quality.json.tmp"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out / "quality.json")
    plots = [plot(result, out) for plot in (plot_quality, plot_quality_curves)] if result["runs"] else []
    return result, [p for p in plots if p is not None]


def dispatch_pairs(jobs: list[Job], *, check: bool = True) -> set[tuple[str, str]]:
    """Compose and (``check``) validate the config of each (model, variant)'s first run before any run starts (a bad
    override: one ``error:`` line, exit 2); returns the pairs whose runs measure a Dispatch plan (Dispatch on and
    no plan file given). Without ``check`` (``--no-run``: the records, not a device, are read) it is composed
    alone: no file or device is looked at."""
    first: dict[tuple[str, str], list[str]] = {}
    for job in jobs:
        first.setdefault((job.model, job.variant), job.overrides)
    runs = list(first.values())
    precisions = [c.precision for c in checked_run_configs(runs)] if check else composed_precisions(runs)
    return {pair for pair, p in zip(first, precisions) if p.dispatch and p.plan is None}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_dir, required=True)
    ap.add_argument("--models", nargs="+", default=["wukong", "interformer"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8_tensorwise", "fp8_rowwise", "loka"],
                    help=f"conf/precision presets or {sorted(PRECISION_VARIANTS)}")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-interval", type=int, default=0, help="evaluate every N steps (0: at the end only)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per run")
    ap.add_argument("--launcher", choices=sorted(LAUNCHERS), default=None,
                    help="default: python for --nproc 1, else torchrun")
    ap.add_argument("--concurrent", type=int, default=1, help="runs at once")
    ap.add_argument("--gpus", type=int, default=0,
                    help="spread the runs over this many GPUs, each run on its own --nproc of them (0: every run "
                         "sees every device)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds after which no run starts")
    ap.add_argument("--share-plan", action="store_true", help="one Dispatch plan per (model, precision)")
    ap.add_argument("--reuse-from", type=Path, default=None,
                    help="another study folder: its finished runs of --reuse and its shared plans are copied in "
                         "first (a study that changes only the other precisions, e.g. with precision.exclude)")
    ap.add_argument("--reuse", nargs="+", default=["bf16", "bf16_mods"], help="the precisions --reuse-from copies")
    ap.add_argument("--no-run", action="store_true",
                    help="start nothing: rewrite quality.json and the plots from the finished runs")
    ap.add_argument("--accept-recorded", action="store_true",
                    help="count finished runs trained with other train.py overrides than this command's as they "
                         "are (without it such runs stop the call)")
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides for every run (after --)")
    args = ap.parse_args(argv)
    args.launcher = args.launcher or ("python" if args.nproc == 1 else "torchrun")
    problems = [f"--precisions: unknown {p!r}; valid: {known_variants()}" for p in args.precisions
                if p not in known_variants()]
    for flag, values in (("--models", args.models), ("--precisions", args.precisions), ("--seeds", args.seeds)):
        if repeated := sorted({str(v) for v in values if values.count(v) > 1}):
            problems.append(f"{flag}: {', '.join(repeated)} given more than once (one run directory per run)")
    if "bf16" not in args.precisions:
        problems.append("--precisions must include bf16: RLL is relative to the BF16 run")
    if args.launcher == "python" and args.nproc != 1:
        problems.append(f"--launcher python runs one process; --nproc {args.nproc} needs --launcher torchrun")
    if args.concurrent < 1 or args.nproc < 1 or args.eval_interval < 0 or args.steps < 1 or args.gpus < 0:
        problems.append("--concurrent, --nproc and --steps must be >= 1, --eval-interval and --gpus >= 0")
    elif args.gpus % args.nproc:
        problems.append(f"--gpus {args.gpus} is not a multiple of --nproc {args.nproc} (each run takes --nproc GPUs)")
    if args.reuse_from is not None and not (args.reuse_from / "runs").is_dir():
        problems.append(f"--reuse-from {args.reuse_from}: not a study folder (no runs/ in it)")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        raise SystemExit(2)
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    out = args.out.resolve()
    overrides = lambda m, v, s: run_overrides(out, m, v, s, steps=args.steps, eval_interval=args.eval_interval,
                                              extra=args.extra)
    every = build_jobs(out, args.models, args.precisions, args.seeds, overrides=overrides,
                       dispatch=lambda m, v: False, share_plan=False)
    if args.no_run:  # it reads records, not a device: the config is only composed, to know the shared plans
        measured = dispatch_pairs(every, check=False) if args.share_plan else set()
    else:
        measured = dispatch_pairs(every)
    jobs = build_jobs(out, args.models, args.precisions, args.seeds, overrides=overrides,
                      share_plan=args.share_plan, dispatch=lambda m, v: (m, v) in measured)
    differs = recorded_differences()
    if args.reuse_from is not None:
        for line in reuse_from(jobs, out, args.reuse_from.resolve(), args.reuse,
                               differs=(lambda job, src: []) if args.accept_recorded else differs):
            print(line)
    for line in filter(None, map(adopt_plan, jobs)):  # measured by a run of an earlier call
        print(line)
    differing = {j.name: found for j in jobs if j.finished() and (found := differs(j, j.run_dir))}
    for name, found in differing.items():
        print(f"{name}: trained with other overrides than this command's ({'; '.join(found)})"
              + ("; counted as recorded (--accept-recorded)" if args.accept_recorded else ""))
    if differing and not args.accept_recorded:
        print(f"error: {len(differing)} finished run(s) were trained with other train.py overrides than this "
              f"command's (listed above); give the command they were trained with, or --accept-recorded to count "
              f"them as recorded", file=sys.stderr)
        raise SystemExit(2)
    if lost := unrecorded_runs(previous_result(out / "quality.json"), out):
        print(f"error: {out / 'quality.json'} holds {len(lost)} run(s) with no record under {out / 'runs'} "
              f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): a new table would lose them; it is left "
              f"as it is: move it away to write one", file=sys.stderr)
        raise SystemExit(2)
    todo = [j for j in jobs if not j.finished()]
    for job in todo:
        if (job.run_dir / "summary.json").exists():
            print(f"{job.name}: not counted ({record_problem(job.run_dir)}); this command trains it again")
    print(f"{len(jobs)} runs: {len(jobs) - len(todo)} finished earlier (reused), {len(todo)} to run, "
          f"up to {args.concurrent} at once ({args.launcher}, {args.nproc} rank(s) each)", flush=True)
    if measured and args.concurrent > 1 and not args.share_plan:
        print("note: a Dispatch plan measured while other runs use the device is skewed; see --share-plan")
    given = sys.argv[1:] if argv is None else argv
    command = [a for a in given if a != "--no-run"]  # the one that trains
    meta = {"command": " ".join(["quality_runs.py", *command]),
            "steps": args.steps, "nproc": args.nproc, "launcher": args.launcher, "concurrent": args.concurrent,
            "gpus": args.gpus,
            "eval_interval": args.eval_interval, "share_plan": args.share_plan, "extra_overrides": args.extra,
            "precision_overrides": {v: precision_overrides(v) for v in args.precisions}}
    if args.no_run:
        meta = redraw_meta(previous_result(out / "quality.json"), meta, " ".join(["quality_runs.py", *given]))
    threads = max(1, (os.cpu_count() or 1) // (args.concurrent * args.nproc))
    launcher = Launcher(args.launcher, args.nproc, threads, gpus=args.gpus)
    failed: list[tuple[Job, str]] = []

    def on_finish(job: Job, code: int, again: bool) -> None:
        launcher.finish(job, code)
        if again:  # ran out of GPU memory beside other runs: it starts again alone
            return
        if not job.finished():
            failed.append((job, f"failed: exit {code}, log {job.log_file}"))
        write_results(out, meta, jobs, failed, differing)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwinds: the runs are stopped
    if args.no_run:
        not_run = [(job, "not started: --no-run") for job in todo]
    else:
        not_run = run_jobs(start_order(todo), concurrent=args.concurrent, budget_s=args.time_budget,
                           start=launcher.start, on_finish=on_finish)
    result, plots = write_results(out, meta, jobs, failed + not_run, differing)
    print(quality_table(result))
    print(f"plots: {', '.join(map(str, plots)) or 'none'}")
    for u in result["unfinished"]:
        print(f"{u['model']}_{u['precision']}_seed{u['seed']}: unfinished, logged to step {u['last_step']} "
              f"(its eval curve is drawn, dashed; not in the table)")
    for entry in result["not_run"]:
        print(f"{entry['run']}: {entry['why']}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
