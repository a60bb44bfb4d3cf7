"""Training throughput through train.py, precision by precision, side by side in one run: what users get.

    python -m scripts.bench_train_throughput --out DIR [--precisions bf16 fp8_rowwise loka] [--warmup-steps 100] \
        [--repeats 3] -- model=wukong_h200 trainer.device=cuda trainer.compile=true data.batch_size=8192 \
        trainer.steps=400

A precision is a conf/precision preset or a ``train_runs.PRECISION_VARIANTS`` name (``fp8_tensorwise_auto``: torchao
with its own size filter, the speed baseline; ``bf16_mods``), or a variant of your own named on the command line:
``--variant bf16_no_fsdp "precision=bf16 sharding.fsdp=false"`` makes ``bf16_no_fsdp`` a name ``--precisions`` takes.
Each precision trains with the same overrides (sharded embeddings, the data pipeline, per-window metrics and logging
included: the whole loop), ``--repeats`` times, each repeat in the reverse order of the last (A B C, C B A, ...:
``train_runs.repeat_orders``). Throughput is the mean examples/s of the logged windows after ``--warmup-steps``
(compilation excluded; a LoKA plan is built before step 0, so it is excluded too); beside it the training's peak GPU
memory (``peak_gpu_memory_gib`` of ``summary.json``), the run's window spread (``train_runs.window_spread``: a machine
slowdown during a run shows there, above ``UNSTEADY``) and the host ms per step the loop waited for its next batch
(``data_wait_ms``, and its share of the step: above ``DATA_PACED`` the run is marked data-paced, its examples/s the
data pipeline's pace rather than the model's). A precision's ratio to the first one is
taken within each repeat (runs next to each other in time) and its median over repeats is reported, with the range.
Evaluation runs once at the end, outside the measured windows. Writes ``DIR/train_throughput.json`` after every run (a
run already there is reused) and ``train_throughput.png`` (examples/s per log window), and prints the table last.
``--profile-step N`` profiles step N of every run (inside the warm-up) and adds its split by phase and kernel kind
(``profile.json``) to the run's entry and a phase table to the output: where each precision's step goes, the whole loop
included.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
from pathlib import Path
from typing import Optional

from loka_trainer.arg_types import non_negative_int, positive_int, writable_dir
from scripts.plot_results import pyplot, throughput_curves
from scripts.provenance import provenance
from scripts.result_files import previous_result, write_result
from scripts.train_runs import (check_measured_runs, check_profile_step, known_variants, measured_run,
                                precision_overrides, print_phase_table, profile_overrides, repeat_orders)

UNSTEADY = 0.10  # a window spread above this marks a run whose mean is not its steady speed
DATA_PACED = 0.10  # a wait for data above this share of the step marks a run paced by its data, not its model


def plot(result: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
    throughput_curves(ax, [(f"{name}: {run['examples_per_s']:,.0f}/s", run["trajectory"], {})
                           for name, run in result["runs"].items()], result["warmup_steps"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_key(precision: str, repeat: int) -> str:
    """The run's name in the JSON: the precision for its first run (so results of one repeat read as before), else
    ``<precision>#<repeat>``."""
    return precision if repeat == 0 else f"{precision}#{repeat}"


def summarize(runs: dict[str, dict], precisions: list[str], repeats: int) -> dict[str, dict]:
    """Per precision: median examples/s over its repeats, the ratios to the first precision within each repeat
    with their median, and the largest window spread. ``runs``: run_key -> {"examples_per_s", "window_spread"}."""
    first = precisions[0]
    out = {}
    for precision in precisions:
        keys = [run_key(precision, r) for r in range(repeats)]
        ratios = [runs[k]["examples_per_s"] / runs[run_key(first, r)]["examples_per_s"]
                  for r, k in enumerate(keys)]
        out[precision] = {"examples_per_s": statistics.median(runs[k]["examples_per_s"] for k in keys),
                          "ratio_to_first": statistics.median(ratios), "ratios": ratios,
                          "max_window_spread": max(runs[k]["window_spread"] for k in keys)}
    return out


def run_variants(names: list[str], custom: list[tuple[str, str]]) -> dict[str, list[str]]:
    """Each name of ``--precisions`` -> its train.py overrides: a ``--variant NAME OVERRIDES`` of the command line
    (the overrides one space-separated string), else a preset or ``PRECISION_VARIANTS`` name. SystemExit (one line)
    for an unknown name, a custom name that shadows a known one, or a custom variant with no overrides."""
    known = known_variants()
    mine = {name: shlex.split(text) for name, text in custom}
    clash = sorted(set(mine) & set(known))
    if clash:
        raise SystemExit(f"error: --variant: {clash} already name a precision; pick another name")
    empty = sorted(name for name, overrides in mine.items() if not overrides)
    if empty:
        raise SystemExit(f"error: --variant: {empty} has no overrides")
    unknown = [name for name in names if name not in mine and name not in known]
    if unknown:
        raise SystemExit(f"error: --precisions: unknown {unknown}; valid: {known} and --variant names")
    return {name: mine[name] if name in mine else precision_overrides(name) for name in names}


def run_flags(max_window_spread: float, data_wait_share: Optional[float]) -> list[str]:
    """A precision's marks in the table: ``unsteady`` (a repeat's log windows spread over ``UNSTEADY``),
    ``data-paced`` (the loop waited for its next batch over ``DATA_PACED`` of the step; None: not measured)."""
    marks = (("unsteady", max_window_spread > UNSTEADY),
             ("data-paced", data_wait_share is not None and data_wait_share > DATA_PACED))
    return [flag for flag, on in marks if on]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_dir, required=True)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8_rowwise", "loka"])
    ap.add_argument("--nproc", type=positive_int, default=1)
    ap.add_argument("--warmup-steps", type=non_negative_int, default=100)
    ap.add_argument("--repeats", type=positive_int, default=1, help="runs per precision, in alternating order")
    ap.add_argument("--profile-step", type=int, default=None,
                    help="profile this step of every run (train.py's callbacks.profiler; inside the warm-up)")
    ap.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"),
                    help="a variant of your own for --precisions: NAME and its train.py overrides as one string")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args()
    if repeated := sorted({p for p in args.precisions if args.precisions.count(p) > 1}):
        ap.error(f"--precisions: {', '.join(repeated)} given more than once (--repeats runs a precision again)")
    check_profile_step(args.profile_step, args.warmup_steps)
    variants = run_variants(args.precisions, args.variant)
    check_measured_runs([[*args.overrides, *variants[p], *profile_overrides(args.profile_step)]
                         for p in args.precisions], args.warmup_steps)
    out_json = args.out / "train_throughput.json"
    result = {"overrides": args.overrides, "variants": variants, "warmup_steps": args.warmup_steps,
              "repeats": args.repeats, "runs": {}}
    done = (previous_result(out_json, keys=("runs",)) or {"runs": {}})["runs"]
    for repeat, order in enumerate(repeat_orders(args.precisions, args.repeats)):
        for precision in order:
            key = run_key(precision, repeat)
            if key not in done:
                run = measured_run(args.out / "runs" / key.replace("#", "_"),
                                   [*args.overrides, *variants[precision]], args.nproc,
                                   warmup_steps=args.warmup_steps, profile_step=args.profile_step)
                done[key] = {"precision": precision, "repeat": repeat, **run}
            result["runs"][key] = done[key]
            write_result(out_json, result)
    # after the runs: naming the device starts a CUDA context in this process, kept off the GPU while they train
    result = {**provenance(), **result, "precisions": summarize(result["runs"], args.precisions, args.repeats)}
    write_result(out_json, result)
    plot(result, args.out / "train_throughput.png")
    first = args.precisions[0]
    print(f"{'precision':>22}  {'examples/s':>10}  {'x ' + first:>10}  {'range':>13}  {'spread':>6}  {'peak GiB':>8}"
          f"  {'data wait ms (of step)':>22}")
    paced = False
    for name, row in result["precisions"].items():
        run = result["runs"][name]
        peak, wait, share = (run.get(k) for k in ("peak_gpu_memory_gib", "data_wait_ms", "data_wait_share"))
        flags = run_flags(row["max_window_spread"], share)
        paced = paced or "data-paced" in flags
        waited = "n/a" if wait is None else f"{wait:.1f}" + ("" if share is None else f" ({share:.0%})")
        print(f"{name:>22}  {row['examples_per_s']:>10,.0f}  {row['ratio_to_first']:>9.3f}x  "
              f"{min(row['ratios']):>5.3f}-{max(row['ratios']):.3f}x  {row['max_window_spread']:>6.1%}  "
              f"{'n/a' if peak is None else f'{peak:.2f}':>8}  {waited:>22}{''.join('  ' + f for f in flags)}")
    if paced:
        print(f"data-paced: the loop waited for its next batch over {DATA_PACED:.0%} of the step, so examples/s is the "
              f"data pipeline's pace there: raise data.workers (with data.prefetch > 0)")
    if args.profile_step is not None:
        print_phase_table(args.profile_step, result["runs"])



if __name__ == "__main__":
    main()
