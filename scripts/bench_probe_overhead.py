"""Overhead of the LoKA Probe where users pay it: train.py with the probe off and on, side by side in one run.

    python -m scripts.bench_probe_overhead --out DIR [--pairs 2] [--nproc 1] [--warmup-steps 100] \
        -- model=wukong_h200 precision=bf16 trainer.device=cuda trainer.compile=true data.batch_size=8192 \
           trainer.steps=500

Each pair trains twice with the same overrides, probe off and on (``callbacks.probe.enabled``,
``callbacks.probe.interval``); pairs alternate the order so that a drifting machine biases neither. Throughput is
the mean examples/s of the logged steps after ``--warmup-steps`` (compilation and the first observations excluded);
overhead = median over pairs of (off / on) - 1. Evaluation is off and nothing is checkpointed, so the runs differ
only by the probe. Run-to-run spread on one machine can exceed the target, so each probe-on run also reports its
overhead measured inside itself (``scripts.train_runs.observed_step_overhead``: each log window holding an
observed step against its nearest unobserved ones), and every run its window spread (``train_runs.window_spread``:
a machine slowdown during the run shows there). ``--interval`` longer than the run after the warm-up observes only
step 0: the probe-on runs then carry the hooks and trackers without observing, which separates their cost from an
observation's. ``--profile-step N`` (inside the warm-up; a multiple of ``--interval``, e.g. 100, is an observed step in
the probe-on runs) profiles step N of every run and prints it by phase: the observed step against the same step
without the probe. Writes ``DIR/probe_overhead.json`` (after every run, so an interrupted study keeps its runs) and
``probe_overhead.png``.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from loka_trainer.arg_types import non_negative_int, positive_int, writable_dir
from scripts.plot_results import pyplot, throughput_curves
from scripts.provenance import provenance
from scripts.result_files import previous_result, write_result
from scripts.train_runs import (check_measured_runs, check_profile_step, measured_run, observed_step_overhead,
                                observes, print_phase_table, profile_overrides)

def plot(result: dict, path: Path) -> None:
    fig, (ax, curve) = pyplot().subplots(1, 2, figsize=(10, 3.5), gridspec_kw={"width_ratios": [1, 2]})
    colors = {"off": "tab:gray", "on": "tab:blue"}
    for mode, color in colors.items():
        ys = [r["examples_per_s"] for r in result["runs"] if r["probe"] == mode]
        ax.scatter([mode] * len(ys), ys, color=color)
    ax.set_ylabel("examples/s (after warm-up)")
    ax.set_title(f"probe overhead {100 * result['overhead']:+.2f}% (interval {result['interval']})")
    throughput_curves(curve, [(f"pair {r['pair']} probe {r['probe']}", r["trajectory"], {"color": colors[r["probe"]]})
                              for r in result["runs"] if r.get("trajectory")], result["warmup_steps"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def probe_overrides(on: bool, interval: int) -> list[str]:
    """train.py's overrides of a probe-on or probe-off run."""
    return [f"callbacks.probe.enabled={on}", f"callbacks.probe.interval={interval}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_dir, required=True)
    ap.add_argument("--pairs", type=positive_int, default=2)
    ap.add_argument("--nproc", type=positive_int, default=1)
    ap.add_argument("--interval", type=positive_int, default=100)
    ap.add_argument("--warmup-steps", type=non_negative_int, default=100)
    ap.add_argument("--profile-step", type=int, default=None,
                    help="profile this step of every run (inside the warm-up; a multiple of --interval is observed)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args()
    check_profile_step(args.profile_step, args.warmup_steps)
    check_measured_runs([[*args.overrides, *probe_overrides(on, args.interval), *profile_overrides(args.profile_step)]
                         for on in (False, True)], args.warmup_steps)
    out_json = args.out / "probe_overhead.json"
    done = (previous_result(out_json, keys=("runs",)) or {"runs": []})["runs"]
    runs = []
    for pair in range(args.pairs):
        for mode in (("off", "on") if pair % 2 == 0 else ("on", "off")):
            prior = [r for r in done if r["pair"] == pair and r["probe"] == mode]
            if prior:
                runs.append(prior[0])
                continue
            probe = probe_overrides(mode == "on", args.interval)
            run = {"pair": pair, "probe": mode,
                   **measured_run(args.out / "runs" / f"pair{pair}_{mode}", [*args.overrides, *probe], args.nproc,
                                  warmup_steps=args.warmup_steps, profile_step=args.profile_step)}
            if mode == "on" and observes(args.warmup_steps, int(run["trajectory"][-1][0]), args.interval):
                run["in_run"] = observed_step_overhead(run["trajectory"], interval=args.interval,
                                                       warmup_steps=args.warmup_steps)
            runs.append(run)
            write_result(out_json, {"overrides": args.overrides, "runs": runs})
    ratios = [next(r for r in runs if r["pair"] == k and r["probe"] == "off")["examples_per_s"]
              / next(r for r in runs if r["pair"] == k and r["probe"] == "on")["examples_per_s"]
              for k in range(args.pairs)]
    # after the runs: naming the device starts a CUDA context in this process, kept off the GPU while they train
    result = {**provenance(), "overrides": args.overrides, "interval": args.interval, "warmup_steps": args.warmup_steps,
              "runs": runs, "overhead_per_pair": [x - 1 for x in ratios], "overhead": statistics.median(ratios) - 1}
    write_result(out_json, result)
    plot(result, args.out / "probe_overhead.png")
    print(" pair  probe  examples/s  window spread")
    for r in runs:
        spread = r.get("window_spread", float("nan"))  # runs recorded before the spread was kept have none
        print(f"{r['pair']:>5}  {r['probe']:>5}  {r['examples_per_s']:>10.0f}  {spread:>12.1%}")
    print(f"probe overhead (median over pairs): {100 * result['overhead']:+.2f}%  (target <= 1%)")
    in_run = [r["in_run"] for r in runs if "in_run" in r]
    print("probe overhead inside the probe-on runs (observed vs unobserved log windows): "
          + ", ".join(f"{100 * x['overhead']:+.2f}% ({x['extra_steps_per_observation']:.1f} steps per observation)"
                      for x in in_run))
    if args.profile_step is not None:
        print_phase_table(args.profile_step, {f"pair {r['pair']} {r['probe']}": r for r in runs})


if __name__ == "__main__":
    main()
