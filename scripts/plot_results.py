"""Tables and plots for docs/results from the JSON the runs wrote (regenerates every figure without re-running).

    python -m scripts.plot_results                      # every figure under docs/results
    python -m scripts.plot_results docs/results/quality_cpu/quality.json [more JSON ...]

Per JSON file name (``PLOTTERS``): ``quality.json`` (quality_runs.py) -> quality_rll.png and a table;
``bench_e2e.json`` (bench_e2e_gpu.py) -> bench_e2e.png and its table; ``bench_fsdp2.json`` (bench_fsdp2_gpu.py)
-> bench_fsdp2.png; ``ablation.json`` (the InterFormer Mods ablation) -> ablation_rll.png via plot_ablation.py.

Relative log loss (RLL) of a run = (its log loss - the BF16 run's log loss of the same seed) / BF16's, in %.
Noise floor = the spread of BF16 itself across seeds: the standard deviation over seeds of each BF16 run's
eval log loss relative to the BF16 mean, in %. A precision is "within noise" when |mean RLL| <= that floor.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

WINDOW = 5  # logged train points per trajectory window


def rll(value: float, baseline: float) -> float:
    return 100.0 * (value - baseline) / baseline


def _by_key(result: dict) -> dict[tuple[str, str, int], dict]:
    return {(r["model"], r["precision"], r["seed"]): r for r in result["runs"]}


def summarize(result: dict) -> list[dict]:
    """One row per (model, precision): mean±std over seeds of eval RLL, NE, AUC, throughput; the noise floor."""
    runs, rows = _by_key(result), []
    models = sorted({r["model"] for r in result["runs"]})
    precisions = list(dict.fromkeys(r["precision"] for r in result["runs"]))
    for m in models:
        seeds = sorted({r["seed"] for r in result["runs"] if r["model"] == m})
        base = [runs[(m, "bf16", s)]["eval"]["eval_logloss"] for s in seeds]
        floor = 100.0 * statistics.pstdev(base) / statistics.mean(base)
        for p in precisions:
            rs = [runs[(m, p, s)] for s in seeds if (m, p, s) in runs]
            rlls = [rll(r["eval"]["eval_logloss"], runs[(m, "bf16", r["seed"])]["eval"]["eval_logloss"]) for r in rs]
            rows.append({"model": m, "precision": p, "seeds": len(rs), "rll_pct_mean": statistics.mean(rlls),
                         "rll_pct_std": statistics.pstdev(rlls), "noise_floor_pct": floor,
                         "eval_ne": statistics.mean(r["eval"]["eval_ne"] for r in rs),
                         "eval_auc": statistics.mean(r["eval"]["eval_auc"] for r in rs),
                         "examples_per_s": statistics.mean(r["examples_per_s"] for r in rs)})
    return rows


def quality_table(result: dict) -> str:
    head = "| model | precision | seeds | eval RLL vs BF16 (%) | BF16 noise floor (%) | eval NE | eval AUC |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in summarize(result):
        lines.append(f"| {r['model']} | {r['precision']} | {r['seeds']} | {r['rll_pct_mean']:+.3f} ± "
                     f"{r['rll_pct_std']:.3f} | {r['noise_floor_pct']:.3f} | {r['eval_ne']:.4f} | {r['eval_auc']:.4f} |")
    return "\n".join(lines)


def trajectory_rll(run: dict, base: dict) -> tuple[list[int], list[float]]:
    """Windowed train-loss RLL over the trajectory (same batches in both runs, so windows align)."""
    steps, loss = zip(*run["train"])
    _, base_loss = zip(*base["train"])
    xs, ys = [], []
    for i in range(0, len(loss) - WINDOW + 1, WINDOW):
        xs.append(steps[i + WINDOW - 1])
        ys.append(rll(sum(loss[i:i + WINDOW]), sum(base_loss[i:i + WINDOW])))
    return xs, ys


def plot_quality(result: dict, out_dir: Path) -> Optional[Path]:
    """The RLL trajectories of every non-BF16 precision; None (no file) when the runs are BF16 only."""
    if all(r["precision"] == "bf16" for r in result["runs"]):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _by_key(result)
    models = sorted({r["model"] for r in result["runs"]})
    precisions = [p for p in dict.fromkeys(r["precision"] for r in result["runs"]) if p != "bf16"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    floors = {r["model"]: r["noise_floor_pct"] for r in summarize(result)}
    for ax, m in zip(axes[0], models):
        seeds = sorted({r["seed"] for r in result["runs"] if r["model"] == m})
        for p in precisions:
            curves = [trajectory_rll(runs[(m, p, s)], runs[(m, "bf16", s)]) for s in seeds if (m, p, s) in runs]
            xs = curves[0][0]
            mean = [statistics.mean(c[1][i] for c in curves) for i in range(len(xs))]
            ax.plot(xs, mean, label=p)
        ax.axhspan(-floors[m], floors[m], color="grey", alpha=0.2, label="BF16 seed noise (eval)")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"{m} (mean over {len(seeds)} seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("relative log loss (%)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Train log loss relative to BF16 of the same seed, windows of {WINDOW} logged steps",
                 fontsize=10 if len(models) == 1 else 12)  # one panel: keep the title inside the figure
    fig.tight_layout()
    path = Path(out_dir) / "quality_rll.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _quality(path: Path) -> None:
    result = json.loads(path.read_text())
    print(quality_table(result))
    print(f"plot: {plot_quality(result, path.parent)}")


def _e2e(path: Path) -> None:
    from scripts.bench_e2e_gpu import plot, recategorized, table  # the benchmark's own plot, from its JSON
    rows = [recategorized(r) for r in json.loads(path.read_text())["rows"]]
    plot(rows, path.parent / "bench_e2e.png")
    print(table(rows))
    print(f"plot: {path.parent / 'bench_e2e.png'}")


def _fsdp2(path: Path) -> None:
    from scripts.bench_fsdp2_gpu import plot  # the benchmark's own plot, from its JSON
    plot(json.loads(path.read_text()), path.parent / "bench_fsdp2.png")
    print(f"plot: {path.parent / 'bench_fsdp2.png'}")


def _ablation(path: Path) -> None:
    from scripts import plot_ablation
    plot_ablation.main()


PLOTTERS = {"quality.json": _quality, "bench_e2e.json": _e2e, "bench_fsdp2.json": _fsdp2, "ablation.json": _ablation}
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, nargs="*", help="result JSON files (default: every one under docs/results)")
    args = ap.parse_args()
    paths = args.json or sorted(p for name in PLOTTERS for p in RESULTS.rglob(name) if "runs" not in p.parts)
    for path in paths:
        if path.name not in PLOTTERS:
            raise SystemExit(f"error: {path}: no plot for a file named {path.name!r}; known: {', '.join(PLOTTERS)}")
        PLOTTERS[path.name](path)


if __name__ == "__main__":
    main()
