"""Summarize the InterFormer no-bias ablation: eval RLL of every variant here vs the published BF16 runs.

    python -m scripts.plot_ablation

Each sub-folder is one `python -m scripts.quality_runs --precisions bf16` run set (its `quality.json` holds the command
and the overrides); the reference is the published-model BF16 run of the same seed in docs/results/quality_cpu.
Writes ablation.json and ablation_rll.png into docs/results/interformer_mods_cpu.
InterFormer's default is `model.mods.keep_bias=[input_arch.merge] model.mods.keep_bias_init=linear`; re-running a
variant without a `keep_bias` override (all_mods, no_bias) needs `model.mods.keep_bias=[]` to get the fully
bias-free model those runs measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parents[1] / "docs" / "results" / "interformer_mods_cpu"
REFERENCE = HERE.parent / "quality_cpu" / "quality.json"


def _eval_logloss(quality: dict, precision: str = "bf16") -> dict[int, float]:
    return {r["seed"]: r["eval"]["eval_logloss"] for r in quality["runs"] if r["precision"] == precision}


def summarize() -> list[dict]:
    """One row per variant folder: overrides, seeds, per-seed and mean/std eval RLL (%) vs published BF16."""
    ref = _eval_logloss(json.loads(REFERENCE.read_text()))
    rows = []
    for path in sorted(HERE.glob("*/quality.json")):
        quality = json.loads(path.read_text())
        rll = {s: 100.0 * (v - ref[s]) / ref[s] for s, v in _eval_logloss(quality).items()}
        values = list(rll.values())
        rows.append({"variant": path.parent.name, "overrides": quality["extra_overrides"][2:],
                     "seeds": sorted(rll), "rll_pct": rll, "rll_pct_mean": statistics.mean(values),
                     "rll_pct_std": statistics.pstdev(values)})
    return rows


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line: no arguments; ``--help`` prints the usage and writes nothing."""
    ap = argparse.ArgumentParser(prog="python -m scripts.plot_ablation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    return ap.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(summarize(), key=lambda r: r["rll_pct_mean"])
    ref = _eval_logloss(json.loads(REFERENCE.read_text()))
    floor = 100.0 * statistics.pstdev(ref.values()) / statistics.mean(ref.values())
    (HERE / "ablation.json").write_text(json.dumps({"noise_floor_pct": floor, "rows": rows}, indent=1) + "\n")
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    labels = [f"{r['variant']} ({len(r['seeds'])} seed{'s' if len(r['seeds']) > 1 else ''})" for r in rows]
    ax.barh(labels, [r["rll_pct_mean"] for r in rows], xerr=[r["rll_pct_std"] for r in rows], color="tab:blue")
    ax.axvspan(-floor, floor, color="grey", alpha=0.3, label=f"BF16 seed noise ({floor:.3f}%)")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("eval RLL vs published BF16 (%), mean ± std over seeds")
    ax.set_title("InterFormer, BF16, 300 steps, 2 CPU ranks: which bias matters")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "ablation_rll.png", dpi=120)
    for r in rows:
        spread = f" ± {r['rll_pct_std']:.3f}" if len(r["seeds"]) > 1 else " (one seed)"
        print(f"| {r['variant']} | `{' '.join(r['overrides'])}` | {len(r['seeds'])} | "
              f"{r['rll_pct_mean']:+.3f}{spread} |")
    print(f"noise floor {floor:.3f}%")


if __name__ == "__main__":
    main()
