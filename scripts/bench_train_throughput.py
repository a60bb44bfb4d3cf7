"""Training throughput through train.py, precision by precision, side by side in one run: what users get.

    python -m scripts.bench_train_throughput --out DIR [--precisions bf16 fp8_rowwise loka] [--warmup-steps 100] \
        -- model=wukong_h200 trainer.device=cuda trainer.compile=true data.batch_size=8192 trainer.steps=400

Each precision trains once with the same overrides (sharded embeddings, the data pipeline, per-window metrics and
logging included: the whole loop). Throughput is the mean examples/s of the logged windows after
``--warmup-steps`` (compilation excluded; a LoKA plan is built before step 0, so it is excluded too); beside it the
training's peak GPU memory (``peak_gpu_memory_gib`` of ``summary.json``). Evaluation runs once at the end, outside
the measured windows. Writes ``DIR/train_throughput.json`` after every run (a run already there is reused) and
``train_throughput.png`` (examples/s per log window), and prints ratios to the first precision last.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from scripts.plot_results import pyplot, throughput_curves
from scripts.train_runs import steady_throughput, throughput_trajectory, train


def plot(result: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
    throughput_curves(ax, [(f"{name}: {run['examples_per_s']:,.0f}/s", run["trajectory"], {})
                           for name, run in result["runs"].items()], result["warmup_steps"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8_rowwise", "loka"])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = ap.parse_args()
    out_json = args.out / "train_throughput.json"
    result = {"overrides": args.overrides, "warmup_steps": args.warmup_steps, "runs": {}}
    done = json.loads(out_json.read_text())["runs"] if out_json.is_file() else {}
    for precision in args.precisions:
        if precision not in done:
            run_dir = args.out / "runs" / precision
            records = train(run_dir, [*args.overrides, f"precision={precision}"], args.nproc)
            summary = json.loads((run_dir / "summary.json").read_text())
            done[precision] = {"examples_per_s": steady_throughput(records, args.warmup_steps),
                               "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"),
                               "trajectory": throughput_trajectory(records)}
        result["runs"][precision] = done[precision]
        args.out.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "train_throughput.png")
    first = args.precisions[0]
    print(f"{'precision':>16}  {'examples/s':>10}  {'x ' + first:>10}  {'peak GiB':>8}")
    for name, run in result["runs"].items():
        ratio = run["examples_per_s"] / result["runs"][first]["examples_per_s"]
        peak = run.get("peak_gpu_memory_gib")
        print(f"{name:>16}  {run['examples_per_s']:>10,.0f}  {ratio:>9.3f}x  "
              f"{'n/a' if peak is None else f'{peak:.2f}':>8}")


if __name__ == "__main__":
    main()
