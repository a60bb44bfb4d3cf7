"""How Dispatch's two GPU timers see a fused Mods layer's whole training step (``mods_timing.time_input_grads``).

    python -m benchmarks.bench_layer_timer_gpu OUT_DIR [--shapes 4096x720x512 ...] [--repeats 3]

Per shape (M×K×N, forward mode), the layer's forward + backward is timed with its BF16 input grad and with the
fused rowwise-FP8 one, by CUDA events on eager calls (``timing.cuda_timer``, Dispatch's GEMM default) and by
CUDA-graph replay (``timing.cuda_graph_timer``), ``--repeats`` times in each candidate order. The spread of
the repeats says whether a timer can choose between the two (``precision.layer_timer``). Writes
OUT_DIR/layer_timer.json and OUT_DIR/layer_timer.png; prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from loka_trainer.dispatch.mods_timing import time_input_grads
from loka_trainer.arg_types import require_cuda
from loka_trainer.timing import GPU_TIMERS

# the Wukong dense arch's fused layers at batch 4096 (interaction-layer MLP inputs, over arch) and their modes
DEFAULT_SHAPES = ("4096x720x512:fused_bf16", "4096x768x512:fused_bf16", "4096x4096x512:split_bf16")
CANDIDATES = ("bf16", "scaled_mm_rowwise")


def parse_shape(text: str) -> tuple[int, int, int, str]:
    """'MxKxN:mode' -> (M, K, N, mode)."""
    dims, _, mode = text.partition(":")
    M, K, N = (int(v) for v in dims.split("x"))
    return M, K, N, mode or "split_bf16"


def spread(times: list[float]) -> dict:
    """min, median, max and (max / min - 1) of repeated µs."""
    s = sorted(times)
    return {"min": s[0], "median": s[len(s) // 2], "max": s[-1], "spread": s[-1] / s[0] - 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), metavar="MxKxN:MODE")
    p.add_argument("--repeats", type=int, default=3, help="per candidate order")
    args = p.parse_args()
    shapes = [parse_shape(s) for s in args.shapes]
    require_cuda(p)
    orders = [list(CANDIDATES), list(reversed(CANDIDATES))] * args.repeats
    runs = []
    with tqdm(total=len(shapes) * len(GPU_TIMERS) * len(orders), desc="layer timer") as bar:
        for M, K, N, mode in shapes:
            for timer_name, make_timer in GPU_TIMERS.items():
                timer = make_timer()
                for order in orders:
                    rounds = time_input_grads(M, K, N, order, mode=mode, wgrad="bf16", block=256, eps=1e-6,
                                              timer=timer, device="cuda", rounds=1)
                    t = {name: None if ts is None else ts[0] for name, ts in rounds.items()}
                    runs.append({"M": M, "K": K, "N": N, "mode": mode, "timer": timer_name, "first": order[0],
                                 "us": t})
                    bar.update(1)
    summary = []
    for M, K, N, mode in shapes:
        for timer_name in GPU_TIMERS:
            mine = [r for r in runs if (r["M"], r["K"], r["N"], r["timer"]) == (M, K, N, timer_name)]
            row = {"M": M, "K": K, "N": N, "mode": mode, "timer": timer_name}
            for c in CANDIDATES:
                row[c] = spread([r["us"][c] for r in mine])
            row["bf16_over_fp8_median"] = row["bf16"]["median"] / row["scaled_mm_rowwise"]["median"]
            summary.append(row)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "runs": runs, "summary": summary}
    (args.out_dir / "layer_timer.json").write_text(json.dumps(result, indent=1))
    plot(runs, shapes, args.out_dir / "layer_timer.png")
    print(f"{'M×K×N':>15} {'timer':<12} {'bf16 µs min/med/max':>26} {'fp8 dgrad µs min/med/max':>28} "
          f"{'spread':>7} {'bf16/fp8':>8}")
    for r in summary:
        b, f = r["bf16"], r["scaled_mm_rowwise"]
        print(f"{r['M']}×{r['K']}×{r['N']:<5} {r['timer']:<12} "
              f"{b['min']:>8.1f}/{b['median']:>7.1f}/{b['max']:>7.1f}    {f['min']:>8.1f}/{f['median']:>7.1f}/"
              f"{f['max']:>7.1f}   {max(b['spread'], f['spread']):>6.0%} {r['bf16_over_fp8_median']:>8.2f}")


def plot(runs: list[dict], shapes, path: Path) -> None:
    """One panel per timer: each repeat's µs per shape and candidate (points), log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(GPU_TIMERS), figsize=(6 * len(GPU_TIMERS), 4), squeeze=False)
    for ax, timer_name in zip(axes[0], GPU_TIMERS):
        for j, c in enumerate(CANDIDATES):
            for i, (M, K, N, _) in enumerate(shapes):
                ys = [r["us"][c] for r in runs if (r["M"], r["K"], r["N"], r["timer"]) == (M, K, N, timer_name)]
                ax.plot([i + 0.15 * (2 * j - 1)] * len(ys), ys, "o", alpha=0.6, color=f"C{j}",
                        label=c if i == 0 else None)
        ax.set_xticks(range(len(shapes)), [f"{M}x{K}x{N}" for M, K, N, _ in shapes], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("µs per layer step")
        ax.set_title(f"{timer_name}: fused Mods layer fwd+bwd")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
