"""The fused Mods forward kernel alone (training forward: h, u and r written): split-K and tile configs.

    python -m benchmarks.bench_fused_forward_gpu OUT_DIR [--shapes 7680x256 4096x2048] [--config-shapes 4096x2048]
        [--grid-stages 2 3]

The config sweep compiles and times ~30 kernels per shape and input dtype: over all nine shapes it ran past 9
minutes on an H200, so ``--config-shapes`` (default: none) picks where it runs; results are written after each
shape (OUT_DIR/fused_forward.partial.json), so a cut run keeps what it measured.

Per Mods layer shape (``MODS_LAYER_SHAPES``: K in, N out; batch M = 1024), bf16 and FP8 (rowwise e4m3 operands,
quantized beforehand):
- ``splits``: cuBLAS GEMM (``x @ wᵀ`` / ``torch._scaled_mm``) + the epilogue kernel, against
  ``triton_mods.fused_forward`` at split_k 1, 2, 4, 8 and the default (``split_k_for``);
- ``configs``: the fused kernel (split_k 1) at every tile config of a small grid (BLOCK_M 16-128, BLOCK_K
  64/128, 4 or 8 warps, ``--grid-stages``, default 3 or 4) and of the autotune list, the list's configs marked:
  is a config outside it faster?

GPU µs from CUDA-graph replay (``triton.testing.do_bench_cudagraph`` median; the ``splits`` rows also report
launch-bound eager time). Writes OUT_DIR/fused_forward.json, fused_forward.png (and
fused_forward_configs.png with a config sweep); prints tables last.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from loka_trainer.kernels.backends_scaled_mm import scaled_mm_nt
from loka_trainer.kernels.triton_quant import quant_rowwise
from loka_trainer.mods import triton_mods
from loka_trainer.arg_types import require_cuda
from loka_trainer.timing import cuda_graph_us
from scripts.bench_timing import time_row
from scripts.mods_layer_variants import BATCH, MODS_LAYER_SHAPES
from scripts.plot_results import grouped_bars, pyplot

SPLITS = (1, 2, 4, 8)
GRID_STAGES = (3, 4)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_K", "num_warps", "num_stages")


def config_grid(stages=GRID_STAGES) -> list[dict]:
    """The sweep's tile configs: BLOCK_M 16-128 x BLOCK_K 64/128 x 4/8 warps x ``stages``, plus every config of
    the kernel's autotune list (so that "best of the list" is always measured; imports triton)."""
    grid = [tuple(c) for c in itertools.product((16, 32, 64, 128), (64, 128), (4, 8), stages)]
    grid += sorted(autotune_list() - set(grid))
    return [dict(zip(CONFIG_KEYS, c)) for c in grid]


def operands(K: int, N: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """x (M, K), w (N, K) bf16, or rowwise e4m3 with their scales as ``fused_forward`` keywords."""
    x = torch.randn(BATCH, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    if not fp8:
        return x, w, {}
    (xq, sx), (wq, sw) = quant_rowwise(x), quant_rowwise(w)
    return xq, wq, dict(x_scale_inv=sx, w_scale_inv=sw)


def bench_splits(K: int, N: int, fp8: bool) -> list[dict]:
    x, w, kw = operands(K, N, fp8)
    cublas = ((lambda: triton_mods.norm_forward(scaled_mm_nt(x, kw["x_scale_inv"], w, kw["w_scale_inv"])))
              if fp8 else (lambda: triton_mods.norm_forward(x @ w.t())))
    auto = triton_mods.split_k_for(BATCH, N, K, 256, triton_mods.sm_count(x.device.index or 0))
    cases = {"cublas_epilogue": cublas, **{f"fused_split{s}": (lambda s=s: triton_mods.fused_forward(x, w, split_k=s, **kw))
                                           for s in SPLITS}}
    rows = []
    for name, fn in cases.items():
        row = {"part": "splits", "K": K, "N": N, "fp8": fp8, "variant": name, "default_split": auto}
        time_row(row, fn)
        rows.append(row)
    return rows


def autotune_list() -> set[tuple[int, int, int, int]]:
    """The fused kernel's autotune configs as (BLOCK_M, BLOCK_K, num_warps, num_stages) (imports triton)."""
    from loka_trainer.mods.triton_mods_kernels import configs
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in configs}


def bench_configs(K: int, N: int, fp8: bool, grid: list[dict]) -> list[dict]:
    x, w, kw = operands(K, N, fp8)
    listed = autotune_list()
    rows = []
    for cfg in grid:
        row = {"part": "configs", "K": K, "N": N, "fp8": fp8, **cfg,
               "autotune_list": tuple(cfg.values()) in listed}
        try:
            row["graph_us"] = cuda_graph_us(lambda: triton_mods.fused_forward(x, w, split_k=1, config=cfg, **kw))
        except Exception as e:  # noqa: BLE001 -- a config that does not compile (shared memory) is reported
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    return rows


def cases(rows: list[dict], part: str) -> list[tuple[int, int, bool]]:
    """The (K, N, fp8) cases of ``part``'s rows, smallest layer first."""
    return sorted({(r["K"], r["N"], r["fp8"]) for r in rows if r["part"] == part}, key=lambda k: (k[0] * k[1], k[2]))


def split_table(rows: list[dict]) -> list[str]:
    variants = ["cublas_epilogue"] + [f"fused_split{s}" for s in SPLITS]
    lines = [f"{'(K, N)':>13} {'fp8':>5} {'default':>7} " + " ".join(f"{v:>15}" for v in variants)]
    for K, N, fp8 in cases(rows, "splits"):
        t = {r["variant"]: r for r in rows if r["part"] == "splits" and (r["K"], r["N"], r["fp8"]) == (K, N, fp8)}
        lines.append(f"{str((K, N)):>13} {str(fp8):>5} {t['cublas_epilogue']['default_split']:>7} "
                     + " ".join(f"{t[v].get('graph_us', float('nan')):15.1f}" for v in variants))
    return lines


def best_configs(rows: list[dict], K: int, N: int, fp8: bool) -> tuple[dict, dict]:
    """(fastest config row of the autotune list, fastest of the whole grid) for one case."""
    ok = [r for r in rows if r["part"] == "configs" and (r["K"], r["N"], r["fp8"]) == (K, N, fp8) and "graph_us" in r]
    fastest = lambda rs: min(rs, key=lambda r: r["graph_us"])  # noqa: E731
    return fastest([r for r in ok if r["autotune_list"]]), fastest(ok)


def config_table(rows: list[dict]) -> list[str]:
    lines = [f"{'(K, N)':>13} {'fp8':>5} {'best of list':>22} {'best overall':>22}"]
    name = lambda r: f"{r['BLOCK_M']}x{r['BLOCK_K']} w{r['num_warps']} s{r['num_stages']} {r['graph_us']:.1f}"  # noqa: E731
    for K, N, fp8 in cases(rows, "configs"):
        best_listed, best = best_configs(rows, K, N, fp8)
        lines.append(f"{str((K, N)):>13} {str(fp8):>5} {name(best_listed):>22} {name(best):>22}")
    return lines


def bars_png(keys: list[tuple[int, int, bool]], series: dict[str, list[float]], title: str, path: Path) -> None:
    """One group of bars (µs) per (K, N, fp8) case, one bar per ``series`` entry; saved as a PNG."""
    fig, ax = pyplot().subplots(figsize=(12, 4))
    grouped_bars(ax, [f"({K},{N}){' fp8' if f else ''}" for K, N, f in keys], series, rotation=35, ha="right",
                 fontsize=8)
    ax.set_ylabel("GPU µs (graph replay)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(rows: list[dict], path: Path, device: str) -> None:
    """Per shape and input dtype: the fused kernel at split 1 and at the default split vs cuBLAS + epilogue."""
    keys = cases(rows, "splits")
    t = {(r["K"], r["N"], r["fp8"], r["variant"]): r.get("graph_us", 0) for r in rows if r["part"] == "splits"}
    default = {(r["K"], r["N"]): f"fused_split{r['default_split']}" for r in rows if r["part"] == "splits"}
    series = {"cuBLAS + epilogue": [t.get((K, N, f, "cublas_epilogue"), 0) for K, N, f in keys],
              "fused, split 1": [t.get((K, N, f, "fused_split1"), 0) for K, N, f in keys],
              "fused, default split": [t.get((K, N, f, default[(K, N)]), 0) for K, N, f in keys]}
    bars_png(keys, series, f"Mods forward (training), batch {BATCH}, {device}", path)


def plot_configs(rows: list[dict], path: Path, device: str) -> None:
    """Per shape and input dtype: the fastest tile config of the autotune list vs of the whole grid (µs)."""
    keys = cases(rows, "configs")
    best = [best_configs(rows, *k) for k in keys]
    series = {"best of the autotune list": [b[0]["graph_us"] for b in best],
              "best of the grid": [b[1]["graph_us"] for b in best]}
    bars_png(keys, series, f"Fused Mods forward kernel (split 1) by tile config, batch {BATCH}, {device}", path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shapes", nargs="+", default=None, metavar="INxOUT")
    p.add_argument("--config-shapes", nargs="*", default=[], metavar="INxOUT",
                   help="shapes that also get the tile-config sweep")
    p.add_argument("--grid-stages", nargs="+", type=int, default=list(GRID_STAGES),
                   help="num_stages values of the config sweep's grid (the autotune list is always swept)")
    args = p.parse_args()
    require_cuda(p)
    parse = lambda specs: [tuple(int(v) for v in s.split("x")) for s in specs]  # noqa: E731
    shapes = parse(args.shapes) if args.shapes else MODS_LAYER_SHAPES
    config_shapes = set(parse(args.config_shapes))
    grid = config_grid(tuple(args.grid_stages)) if config_shapes else []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": " ".join(sys.argv), "batch": BATCH}
    rows = []
    for K, N in tqdm(shapes, desc="fused forward"):
        for fp8 in (False, True):
            rows += bench_splits(K, N, fp8)
            if (K, N) in config_shapes:
                rows += bench_configs(K, N, fp8, grid)
        (args.out_dir / "fused_forward.partial.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (args.out_dir / "fused_forward.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    plot(rows, args.out_dir / "fused_forward.png", meta["device"])
    print("\n".join(split_table(rows)))
    if config_shapes:
        plot_configs(rows, args.out_dir / "fused_forward_configs.png", meta["device"])
        print("\n".join(config_table(rows)))


if __name__ == "__main__":
    main()
