"""Human-readable views of a probe report dict: a Markdown table and a PNG (MERE learned vs normal, speedup)."""
from __future__ import annotations

from pathlib import Path

from loka_trainer.atomic_files import atomic_write


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def render_markdown(report: dict) -> str:
    """One row per (layer, backend); flags spelled out."""
    lines = [
        "# LoKA Probe report",
        "",
        f"Device: {report['device']}. Samples per layer: {report['num_samples']}. "
        f"Unsafe: MERE >= {report['threshold']}. Not worth it: speedup <= {report['min_speedup']}x over bf16.",
        f"MERE denominator floored at {report['zero_floor']:g} x mean|ref|; kernel and fp32 reference get the same "
        f"{report['operand_dtype']} operands (see loka_trainer/probe/mere.py). User kernels are named module:function.",
        "Flushed: mean fraction of the learned x's or w's nonzero values (the larger) that the forward FP8 cast sets "
        "to zero (loka_trainer/probe/flush.py).",
        "",
        "| layer | M x K x N | representation | backend | MERE (learned) | MERE (normal) | learned/normal "
        "| flushed (learned) | speedup | flags |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for fqn, layer in report["layers"].items():
        s = layer["shape"]
        for name, c in layer["candidates"].items():
            ratio = c["mere"] / c["mere_normal"] if c["mere_normal"] > 0 else None
            flags = ", ".join(f for f, on in (("unsafe", c["unsafe"]), ("not worth it", c["not_worth_it"])) if on)
            lines.append(f"| {fqn} | {s['M']}x{s['K']}x{s['N']} | {layer['representation']} | {name} "
                         f"| {c['mere']:.4g} | {c['mere_normal']:.4g} | {_fmt(ratio, '.2f')} "
                         f"| {_fmt(c.get('flushed'), '.4f')} | {_fmt(c['speedup'], '.2f')} | {flags or 'ok'} |")
    return "\n".join(lines) + "\n"


def render_plot(report: dict, path: Path) -> None:
    """``render_figure`` written to ``path`` (PNG), replacing it whole (``atomic_files.atomic_write``)."""
    import matplotlib.pyplot as plt

    fig = render_figure(report)
    try:
        atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)


def render_figure(report: dict):
    """Per layer: grouped bars of MERE (learned solid, normal hatched, log scale) and speedup per backend, one
    colour per backend in both panels. Returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fqns = list(report["layers"])
    backends = sorted({n for layer in report["layers"].values() for n in layer["candidates"]})
    width = 0.8 / max(1, len(backends))
    fig, (ax_err, ax_speed) = plt.subplots(2, 1, figsize=(max(6, 1.2 * len(fqns) + 3), 8), sharex=True)
    palette = plt.get_cmap("tab20")  # one colour per backend, the same in both panels (20 before any repeats)
    for i, name in enumerate(backends):
        color = palette(i % palette.N)
        xs, learned, normal, speed = [], [], [], []
        for j, fqn in enumerate(fqns):
            c = report["layers"][fqn]["candidates"].get(name)
            if c is None:
                continue
            xs.append(j + i * width)
            learned.append(max(c["mere"], 1e-8))
            normal.append(max(c["mere_normal"], 1e-8))
            speed.append(c["speedup"] or 0.0)
        ax_err.bar(xs, learned, width, label=name, color=color)
        ax_err.bar(xs, normal, width, fill=False, hatch="//", edgecolor=color)
        ax_speed.bar(xs, speed, width, label=name, color=color)
    ax_err.axhline(report["threshold"], color="red", linestyle="--", linewidth=1, label="threshold")
    ax_err.set_yscale("log")
    ax_err.set_ylabel("MERE (solid: learned, hatched: normal)")
    ax_err.legend(fontsize=7, ncol=2)
    ax_speed.axhline(report["min_speedup"], color="red", linestyle="--", linewidth=1)
    ax_speed.set_ylabel(f"forward speedup over bf16 ({report['device']})")
    ax_speed.set_xticks([j + 0.4 - width / 2 for j in range(len(fqns))])
    ax_speed.set_xticklabels(fqns, rotation=45, ha="right", fontsize=7)
    fig.tight_layout()
    return fig
