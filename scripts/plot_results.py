"""Tables and plots for docs/results from the JSON the runs wrote (regenerates every figure without re-running).

    python -m scripts.plot_results                      # every figure under docs/results
    python -m scripts.plot_results docs/results/quality_cpu/quality.json [more JSON ...]

Per JSON file name (``PLOTTERS``): ``quality.json`` (quality_runs.py) -> quality_rll.png, quality_curve.png (eval
log loss vs step, when the runs evaluated during training; a run that stopped before its end, ``unfinished``,
dashed to its last evaluation) and a table;
``bench_e2e.json`` (bench_e2e_gpu.py) -> bench_e2e.png and its table; ``bench_fsdp2.json`` (bench_fsdp2_gpu.py)
-> bench_fsdp2.png; ``ablation.json`` (the InterFormer Mods ablation) -> ablation_rll.png via plot_ablation.py.

Relative log loss (RLL) of a run = (its log loss - the BF16 run's log loss of the same seed) / BF16's, in %.
Noise floor = the spread of BF16 itself across seeds: the standard deviation over seeds of each BF16 run's
eval log loss relative to the BF16 mean, in %. A precision is "within noise" when |mean RLL| <= that floor.
LoKA vs BF16+Mods: the RLL of ``loka`` against ``bf16_mods`` (the same Mods model without FP8) of the same seed.
Every "std" is the population standard deviation over the seeds (``statistics.pstdev``: divides by n, not n - 1).
A metric a run recorded as null (non-finite, e.g. NE or AUC over one class, or no logged throughput) makes each
statistic over it null: the table prints ``null``, not a mean of the other seeds.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Optional

WINDOW = 5  # log intervals per train-loss trajectory window


def rll(value: Optional[float], baseline: Optional[float]) -> float:
    """(value - baseline) / baseline in %; NaN when either is null (a non-finite metric in the run's record)."""
    if value is None or baseline is None:
        return math.nan
    return 100.0 * (value - baseline) / baseline


# precision -> the same model without FP8 (``quality_runs.PRECISION_VARIANTS``): the RLL against it is the effect
# of the FP8 GEMMs alone, with the Mods' own effect taken out
MODS_BASELINES: dict[str, str] = {"loka": "bf16_mods"}


def _by_key(result: dict) -> dict[tuple[str, str, int], dict]:
    return {(r["model"], r["precision"], r["seed"]): r for r in result["runs"]}


def _finite(values: list[Optional[float]]) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def _mean(values: list[Optional[float]]) -> float:
    """The mean; NaN when a value is null or non-finite (``statistics`` cannot take them)."""
    return statistics.mean(values) if _finite(values) else math.nan


def _mean_std(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    """(mean, population std over the values); the std is None below two values (one seed has no spread); both
    NaN when a value is."""
    if not values:
        return None, None
    std = (statistics.pstdev(values) if _finite(values) else math.nan) if len(values) > 1 else None
    return _mean(values), std


def paired_rll(runs: dict, model: str, precision: str, baseline: str, seeds: list[int]) -> list[float]:
    """Eval RLL (%) of ``precision`` vs ``baseline`` for each seed that has both runs (a partial table may not)."""
    return [rll(runs[(model, precision, s)]["eval"]["eval_logloss"], runs[(model, baseline, s)]["eval"]["eval_logloss"])
            for s in seeds if (model, precision, s) in runs and (model, baseline, s) in runs]


def noise_floor(logloss: list[float]) -> Optional[float]:
    """Population std over seeds of the BF16 eval log loss relative to its mean, in %; None below two seeds, NaN
    when a seed's log loss is null."""
    if len(logloss) < 2:
        return None
    return 100.0 * statistics.pstdev(logloss) / statistics.mean(logloss) if _finite(logloss) else math.nan


def summarize(result: dict) -> list[dict]:
    """One row per (model, precision): mean±std over seeds of eval RLL vs BF16 (and vs the BF16 Mods model,
    ``MODS_BASELINES``), NE, AUC, throughput; the noise floor; how many seeds each number has (``*_seeds``).
    Works on a partial result: a statistic whose runs are missing is None."""
    runs, rows = _by_key(result), []
    models = sorted({r["model"] for r in result["runs"]})
    precisions = list(dict.fromkeys(r["precision"] for r in result["runs"]))
    for m in models:
        seeds = sorted({r["seed"] for r in result["runs"] if r["model"] == m})
        base = [runs[(m, "bf16", s)]["eval"]["eval_logloss"] for s in seeds if (m, "bf16", s) in runs]
        for p in precisions:
            rs = [runs[(m, p, s)] for s in seeds if (m, p, s) in runs]
            if not rs:
                continue
            rlls = paired_rll(runs, m, p, "bf16", seeds)
            mean, std = _mean_std(rlls)
            row = {"model": m, "precision": p, "seeds": len(rs), "rll_pct_mean": mean, "rll_pct_std": std,
                   "rll_seeds": len(rlls), "noise_floor_pct": noise_floor(base), "noise_floor_seeds": len(base),
                   "eval_ne": _mean([r["eval"]["eval_ne"] for r in rs]),
                   "eval_auc": _mean([r["eval"]["eval_auc"] for r in rs]),
                   "examples_per_s": _mean([r["examples_per_s"] for r in rs])}
            mods = paired_rll(runs, m, p, MODS_BASELINES[p], seeds) if p in MODS_BASELINES else []
            if mods:
                mean, std = _mean_std(mods)
                row.update(mods_baseline=MODS_BASELINES[p], rll_vs_mods_pct_mean=mean, rll_vs_mods_pct_std=std,
                           rll_vs_mods_seeds=len(mods))
            rows.append(row)
    return rows


def _number(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "null"


def _rll_cell(mean: Optional[float], std: Optional[float], n: int) -> str:
    if mean is None:
        return "n/a"
    if not math.isfinite(mean):
        return f"null (n={n})"
    return f"{mean:+.3f} (n={n})" if std is None else f"{mean:+.3f} ± {std:.3f} (n={n})"


def quality_table(result: dict) -> str:
    """Markdown table of ``summarize``: each RLL and noise-floor cell says over how many seeds (n) it is."""
    head = ("| model | precision | seeds | eval RLL vs BF16 (%) | BF16 noise floor (%) | eval RLL vs BF16+Mods (%) "
            "| eval NE | eval AUC |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in summarize(result):
        floor = ("n/a" if r["noise_floor_pct"] is None
                 else f"{_number(r['noise_floor_pct'], '.3f')} (n={r['noise_floor_seeds']})")
        mods = (_rll_cell(r["rll_vs_mods_pct_mean"], r["rll_vs_mods_pct_std"], r["rll_vs_mods_seeds"])
                if "mods_baseline" in r else "")
        lines.append(f"| {r['model']} | {r['precision']} | {r['seeds']} | "
                     f"{_rll_cell(r['rll_pct_mean'], r['rll_pct_std'], r['rll_seeds'])} | {floor} | {mods} | "
                     f"{_number(r['eval_ne'], '.4f')} | {_number(r['eval_auc'], '.4f')} |")
    return "\n".join(lines)


def trajectory_rll(run: dict, base: dict) -> list[list[float]]:
    """Windowed train-loss RLL over the trajectory: [[last step of the window, RLL %], ...].

    ``run["train"]`` and ``base["train"]``: [[step, loss of the log window ending there], ...] (read_run). A window
    is ``WINDOW`` log intervals of the baseline (its interval: the gcd of its logged steps), ending at a multiple of
    ``WINDOW`` intervals, so every seed's windows end at the same steps; only windows the baseline reached are
    drawn. Each compares the two runs' summed losses over the steps of the window that both logged (the same step
    of two runs of one seed trained on the same batches), so a step only one run logged (a log window skipped for a
    non-finite loss) never pairs different steps; a window without such a step is left out."""
    loss, base_loss = dict(run["train"]), dict(base["train"])
    if not loss or not base_loss:
        return []
    span = WINDOW * math.gcd(*base_loss)
    windows: dict[int, list[int]] = {}
    for s in sorted(base_loss.keys() & loss.keys()):
        windows.setdefault(-(-s // span) * span, []).append(s)
    return [[end, rll(sum(loss[s] for s in steps), sum(base_loss[s] for s in steps))]
            for end, steps in windows.items() if end <= max(base_loss)]


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], **tick_kw) -> None:
    """One group of bars per entry of ``groups``, one bar per ``series`` entry (label -> one value per group),
    the group's label under its centre (``tick_kw`` passed to ``set_xticks``), and the legend."""
    width = 0.8 / len(series)
    for i, (label, ys) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, **tick_kw)
    ax.legend(fontsize=7)


def throughput_curves(ax, curves: list[tuple[str, list[list[float]], dict]], warmup_steps: int) -> None:
    """examples/s per log window against the step, one line per (label, [[step, examples/s], ...], line style),
    a dotted line at the end of the warm-up."""
    for label, trajectory, style in curves:
        steps, ys = zip(*trajectory)
        ax.plot(steps, ys, lw=1, label=label, **style)
    ax.axvline(warmup_steps, color="k", lw=0.5, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("examples/s (per log window)")
    ax.legend(fontsize=7)


def plot_quality(result: dict, out_dir: Path) -> Optional[Path]:
    """The RLL trajectories of every non-BF16 precision (seeds that have a BF16 run); None (no file) when there is
    nothing to draw (BF16 runs only, or none paired with one yet)."""
    runs = _by_key(result)
    models = sorted({r["model"] for r in result["runs"]})
    precisions = [p for p in dict.fromkeys(r["precision"] for r in result["runs"]) if p != "bf16"]
    paired = lambda m, p: [s for s in sorted({r["seed"] for r in result["runs"] if r["model"] == m})
                           if (m, p, s) in runs and (m, "bf16", s) in runs]
    if not any(paired(m, p) for m in models for p in precisions):
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    floors = {r["model"]: r["noise_floor_pct"] for r in summarize(result)}
    for ax, m in zip(axes[0], models):
        for p in precisions:
            curves = [trajectory_rll(runs[(m, p, s)], runs[(m, "bf16", s)]) for s in paired(m, p)]
            if not curves:
                continue
            ax.plot(*mean_curve(curves), label=f"{p} (n={len(curves)})")
        if floors[m] is not None and math.isfinite(floors[m]):
            ax.axhspan(-floors[m], floors[m], color="grey", alpha=0.2, label="BF16 seed noise (eval)")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"{m} (mean over seeds)")
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


def mean_curve(curves: list[list[list[float]]]) -> tuple[list[int], list[float]]:
    """[[step, value], ...] per seed -> (steps every curve has, the mean over the curves at each)."""
    values = [dict((int(s), v) for s, v in c if v is not None) for c in curves]
    steps = sorted(set.intersection(*(set(v) for v in values))) if values else []
    return steps, [statistics.mean(v[s] for v in values) for s in steps]


CURVE_STYLES = {"seed": {"lw": 0.6, "alpha": 0.4}, "mean": {"lw": 2}, "unfinished": {"lw": 1.2, "ls": "--"}}


def eval_curve_lines(result: dict) -> dict[str, list[tuple[str, str, list[list[float]], Optional[str]]]]:
    """The lines of the eval log loss plot, per model: (precision, kind, [[step, loss], ...], legend label or None)
    with kind ``seed`` (each finished run), ``mean`` (over a precision's finished seeds, the steps all have) or
    ``unfinished`` (a run that stopped before its end: its evaluations so far, ``result["unfinished"]``). A run
    with fewer than two eval points draws nothing; a model with nothing to draw has no entry."""
    has_curve = lambda r: len(r.get("eval_curve", [])) > 1
    finished = [r for r in result["runs"] if has_curve(r)]
    unfinished = [u for u in result.get("unfinished", []) if has_curve(u)]
    lines: dict[str, list] = {}
    for m in sorted({r["model"] for r in finished + unfinished}):
        for p in dict.fromkeys(r["precision"] for r in result["runs"] + unfinished):
            curves = [r["eval_curve"] for r in finished if r["model"] == m and r["precision"] == p]
            lines.setdefault(m, []).extend((p, "seed", c, None) for c in curves)
            steps, mean = mean_curve(curves)
            if steps:
                lines[m].append((p, "mean", [[x, y] for x, y in zip(steps, mean)], f"{p} (n={len(curves)})"))
            lines[m].extend((p, "unfinished", u["eval_curve"], f"{p} seed {u['seed']}, stopped at step "
                             f"{u['last_step']}") for u in unfinished if u["model"] == m and u["precision"] == p)
    return lines


def plot_quality_curves(result: dict, out_dir: Path) -> Optional[Path]:
    """Eval log loss vs step (quality_runs --eval-interval), one panel per model: per precision the mean over
    seeds (thick), each seed (thin) and any unfinished run (dashed), ``eval_curve_lines``. None (no file) when no
    run has two eval points (older JSON has none)."""
    lines = eval_curve_lines(result)
    if not lines:
        return None
    plt = pyplot()
    colors = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(p for ls in lines.values() for p, *_ in ls))}
    fig, axes = plt.subplots(1, len(lines), figsize=(6 * len(lines), 4), squeeze=False)
    for ax, (m, model_lines) in zip(axes[0], lines.items()):
        for p, kind, curve, label in model_lines:
            ax.plot(*zip(*curve), color=colors[p], label=label, **CURVE_STYLES[kind])
        ax.set_title(m)
        ax.set_xlabel("step")
        ax.set_ylabel("eval log loss")
        ax.legend(fontsize=8)
    dashed = "\ndashed: a run that stopped before its last step, to its last evaluation" if result.get("unfinished") else ""
    fig.suptitle(f"Eval log loss during training: mean over seeds (thick), each seed (thin){dashed}",
                 fontsize=10 if len(lines) == 1 else 12)
    fig.tight_layout()
    path = Path(out_dir) / "quality_curve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _quality(path: Path) -> None:
    result = json.loads(path.read_text())
    print(quality_table(result))
    print(f"plot: {plot_quality(result, path.parent)}, curve: {plot_quality_curves(result, path.parent)}")


def _e2e(path: Path) -> None:
    from scripts.bench_e2e_gpu import plot, table  # the benchmark's own plot, from its JSON
    from scripts.kernel_split import recategorized
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
        try:
            PLOTTERS[path.name](path)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged or foreign file: name it, draw the rest
            raise SystemExit(f"error: {path}: not a readable {path.name} ({type(exc).__name__}: {exc}); "
                             f"the plots before it were drawn") from None


if __name__ == "__main__":
    main()
