"""The pieces of one Mods layer timed alone: its three GEMMs per FP8 recipe (operands pre-quantized) and
the quantization kernels of their operands.

    python -m benchmarks.bench_mods_layer_gemms_gpu OUT_DIR [--shapes 4096x2048 7680x256]

Per Mods layer shape (``MODS_LAYER_SHAPES``: K in, N out; batch M = 1024) the three GEMMs of the layer, each as
``a (R, C) · b (P, C)ᵀ``: forward (M, K, N), input grad (M, N, K), weight grad (N, M, K). Recipes: ``bf16`` (cuBLAS), ``tw_e4m3``
(``torch._scaled_mm`` tensorwise, both e4m3), ``tw_e5m2`` (tensorwise, e5m2 gradient operand · e4m3: the
``scaled_mm_tensorwise`` recipe's input/weight grads), ``rowwise`` (``torch._scaled_mm`` rowwise e4m3). Then the
quantizers on x (M, K), dz (M, N) and their transposed views: ``quant_rowwise`` and ``quant_tensorwise``.
This is what bounds a fused layer: its GEMM time at best, plus what it pays to quantize.

GPU µs from CUDA-graph replay (``timing.cuda_graph_us`` median). Writes OUT_DIR/mods_layer_gemms.json
and a PNG (GEMM speedup vs BF16 per shape and recipe); prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from loka_trainer.kernels.triton_quant import quant_rowwise
from loka_trainer.kernels.triton_quant_tensorwise import quant_tensorwise
from scripts.bench_timing import time_row
from scripts.mods_layer_variants import BATCH, MODS_LAYER_SHAPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GEMMS = ("forward", "input_grad", "weight_grad")


def gemm_dims(M: int, K: int, N: int) -> dict[str, tuple[int, int, int]]:
    """GEMM name -> (R, C, P) of ``a (R, C) · b (P, C)ᵀ`` for one Linear x (M, K) -> (M, N)."""
    return dict(zip(GEMMS, [(M, K, N), (M, N, K), (N, M, K)]))


def _scaled(R: int, C: int, P: int, a_dtype, rowwise: bool):
    """A ``torch._scaled_mm`` call on random pre-quantized operands: a (R, C) ``a_dtype``, b (P, C) e4m3."""
    a = torch.randn(R, C, device="cuda").to(a_dtype)
    b = torch.randn(P, C, device="cuda").to(E4M3)
    sa = torch.ones(R, 1, device="cuda") if rowwise else torch.ones((), device="cuda")
    sb = torch.ones(1, P, device="cuda") if rowwise else torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _bf16(R: int, C: int, P: int):
    a = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(P, C, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ b.t()


GEMM_RECIPES = {
    "bf16": _bf16,
    "tw_e4m3": lambda R, C, P: _scaled(R, C, P, E4M3, rowwise=False),
    "tw_e5m2": lambda R, C, P: _scaled(R, C, P, E5M2, rowwise=False),
    "rowwise": lambda R, C, P: _scaled(R, C, P, E4M3, rowwise=True),
}

QUANTIZERS = {
    "quant_rowwise": lambda t: quant_rowwise(t),
    "quant_tensorwise": lambda t: quant_tensorwise(t, E4M3),
}


def bench_shape(K: int, N: int) -> list[dict]:
    rows = []
    for gemm, (R, C, P) in gemm_dims(BATCH, K, N).items():
        for recipe, make in GEMM_RECIPES.items():
            row = {"K": K, "N": N, "kind": "gemm", "op": gemm, "recipe": recipe, "R": R, "C": C, "P": P}
            time_row(row, make(R, C, P))
            rows.append(row)
    for operand, cols in (("x", K), ("dz", N)):
        t = torch.randn(BATCH, cols, device="cuda", dtype=torch.bfloat16)
        for layout, view in (("rows", t), ("transposed", t.t())):
            for name, quant in QUANTIZERS.items():
                row = {"K": K, "N": N, "kind": "quant", "op": f"{operand}_{layout}", "recipe": name,
                       "R": view.shape[0], "C": view.shape[1]}
                time_row(row, lambda quant=quant, view=view: quant(view))
                rows.append(row)
    return rows


def shapes_of(rows: list[dict]) -> list[tuple[int, int]]:
    """The (K, N) shapes in ``rows``, smallest layer first."""
    return sorted({(r["K"], r["N"]) for r in rows}, key=lambda s: s[0] * s[1])


def gemm_times(rows: list[dict], K: int, N: int, recipe: str) -> list[float]:
    """µs of the forward, input-grad and weight-grad GEMM of shape (K, N) on ``recipe`` (nan where missing)."""
    t = {r["op"]: r.get("graph_us") for r in rows
         if (r["K"], r["N"]) == (K, N) and r["kind"] == "gemm" and r["recipe"] == recipe}
    return [t.get(op) or math.nan for op in GEMMS]


def summarize(rows: list[dict]) -> list[str]:
    """Per shape: each recipe's three-GEMM sum and its ratio to BF16; the quantizers' µs."""
    lines = [f"{'(K, N)':>13} {'recipe':>16} {'forward':>8} {'in_grad':>8} {'w_grad':>8} {'sum':>8} {'vs bf16':>8}"]
    for K, N in shapes_of(rows):
        base = sum(gemm_times(rows, K, N, "bf16"))
        for recipe in GEMM_RECIPES:
            ts = gemm_times(rows, K, N, recipe)
            lines.append(f"{str((K, N)):>13} {recipe:>16} " + " ".join(f"{t:8.1f}" for t in ts)
                         + f" {sum(ts):8.1f} {base / sum(ts):7.2f}x")
        for r in rows:
            if (r["K"], r["N"]) == (K, N) and r["kind"] == "quant":
                lines.append(f"{str((K, N)):>13} {r['recipe']:>16} {r['op']} ({r['R']}, {r['C']}): "
                             f"{r.get('graph_us') or math.nan:.1f} us")
    return lines


def plot(rows: list[dict], path: Path, device: str) -> None:
    """Bar chart: per shape, each FP8 recipe's three-GEMM speedup vs BF16."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = shapes_of(rows)
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / (len(GEMM_RECIPES) - 1)
    for i, recipe in enumerate(r for r in GEMM_RECIPES if r != "bf16"):
        ratios = [sum(gemm_times(rows, K, N, "bf16")) / sum(gemm_times(rows, K, N, recipe)) for K, N in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], ratios, width, label=recipe)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width for j in range(len(shapes))], [str(s) for s in shapes], rotation=20)
    ax.set_ylabel("3-GEMM speedup vs BF16 (pre-quantized)")
    ax.set_title(f"Mods layer GEMMs, batch {BATCH}, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shapes", nargs="+", default=None, metavar="INxOUT")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else MODS_LAYER_SHAPES
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for K, N in tqdm(shapes, desc="mods layer gemms"):
        rows += bench_shape(K, N)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": " ".join(sys.argv), "batch": BATCH}
    (args.out_dir / "mods_layer_gemms.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    plot(rows, args.out_dir / "mods_layer_gemms.png", meta["device"])
    print("\n".join(summarize(rows)))


if __name__ == "__main__":
    main()
