"""Quality runs for the evidence report: every (model, precision, seed) trained on the same planted-teacher data.

    python -m scripts.quality_runs --out docs/results/quality_cpu --steps 300 --seeds 0 1 2 \
        --models wukong interformer --precisions bf16 fp8_tensorwise fp8_rowwise loka [-- extra overrides]

Each run is `torchrun --nproc_per_node=N train.py model=M precision=P trainer.seed=S ...` with the data seed
fixed, so runs of one seed see identical batches and their train losses are comparable window by window.
Writes `<out>/quality.json` (per run: the train-loss trajectory and final eval metrics; plus relative log loss
(RLL) vs the BF16 run of the same seed and the BF16 seed-to-seed noise floor) and draws the plots with
`scripts.plot_results`. Runs already finished under `<out>/runs/` are reused.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from scripts.plot_results import plot_quality, quality_table

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py and conf/


def run_one(run_dir: Path, model: str, precision: str, seed: int, *, steps: int, nproc: int,
            extra: list[str]) -> dict:
    if not (run_dir / "summary.json").is_file():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / "train.py"), f"model={model}", f"precision={precision}", f"trainer.seed={seed}",
               f"trainer.steps={steps}", "trainer.eval_interval=0", "trainer.resume=false",
               "callbacks.progress=false", f"hydra.run.dir={run_dir}", *extra]
        log = run_dir.with_suffix(".log")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"run failed: {' '.join(cmd)} (log: {log})")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"model": model, "precision": precision, "seed": seed,
            "train": [[r["step"], r["loss"]] for r in records if "loss" in r],
            "eval": {k: summary[k] for k in ("eval_logloss", "eval_ne", "eval_auc")},
            "examples_per_s": summary["examples_per_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=["wukong", "interformer"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8_tensorwise", "fp8_rowwise", "loka"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="extra Hydra overrides for every run (after --)")
    args = ap.parse_args()
    if "bf16" not in args.precisions:
        raise SystemExit("--precisions must include bf16: RLL is relative to the BF16 run")
    jobs = [(m, p, s) for m in args.models for s in args.seeds for p in args.precisions]
    runs = []
    for m, p, s in tqdm(jobs, desc="quality runs", unit="run"):
        runs.append(run_one(args.out / "runs" / f"{m}_{p}_seed{s}", m, p, s, steps=args.steps,
                            nproc=args.nproc, extra=args.extra))
    result = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "steps": args.steps,
              "nproc": args.nproc, "extra_overrides": args.extra, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(result, indent=1) + "\n")
    print(quality_table(result))
    print(f"plots: {plot_quality(result, args.out)}")


if __name__ == "__main__":
    main()
