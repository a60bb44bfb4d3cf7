"""GPU benchmark: the whole BF16 backward of a Mods layer in one kernel (``triton_mods_bwd``) vs the dz kernel and
two cuBLAS GEMMs, side by side in one run.

    python scripts/bench_one_kernel_bwd_gpu.py OUT_DIR

(1) The backward alone at (K, N) = (256, 256) and (512, 512), batch 1024, per kernel config, and the config's dx
programs alone (the grid cut to them), against the dz kernel, each cuBLAS GEMM, and dz + both GEMMs in order and
on two streams. (2) The figure-13 suite's BF16 modes (and the fused FP8 forward, whose backward is BF16) at all
nine shapes, fwd+bwd, with the one-kernel backward forced on at every shape and switched off
(``*_no_one_kernel_bwd``). GPU time from CUDA-graph replay. Writes OUT_DIR/one_kernel_bwd.json and .png.
"""
from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loka_trainer.kernels import triton_mods, triton_mods_bwd  # noqa: E402
from loka_trainer.kernels.mods_ops import mods_forward_ref  # noqa: E402
from loka_trainer.kernels.streams import side_by_side  # noqa: E402
from loka_trainer.kernels.triton_mods import autotune_picks  # noqa: E402

import bench_dispatch_gpu  # noqa: E402
from fig13_variants import BATCH, FIG13_SHAPES  # noqa: E402

SWEEP_SHAPES = [(256, 256), (512, 512)]
# (BLOCK_M, BLOCK_K, ROWS_W, M_SPLITS, num_warps)
SWEEP_CONFIGS = [(32, 64, 32, s, 4) for s in (1, 2, 4, 8, 16)] + [
    (64, 64, 32, 4, 8), (64, 64, 32, 16, 8), (32, 128, 32, 4, 8), (16, 64, 32, 4, 4), (32, 64, 64, 4, 8),
    (64, 128, 32, 2, 8), (128, 64, 32, 4, 8)]
FIG13_VARIANTS = ["base_eager", "split_bf16", "split_bf16_no_one_kernel_bwd", "fused_bf16",
                  "fused_bf16_no_one_kernel_bwd", "fused_fp8_fwd", "fused_fp8_fwd_no_one_kernel_bwd"]


def graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    fn()
    torch.cuda.synchronize()
    return 1e3 * float(do_bench_cudagraph(fn, rep=30, return_mode="median"))


def _dx_programs_only(dy, u, r, x, w, cfg: dict):
    """The one kernel launched with only its dx programs (the grid cut before the dW programs)."""
    import triton
    (M, K), N = x.shape, w.shape[0]
    dx = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    ws, count = triton_mods_bwd._workspace(x.device, N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(K, cfg["BLOCK_K"]),)
    kernel = triton_mods_bwd._kernel().fn
    return lambda: kernel[grid](dy, u, r, x, w, dx, dx, ws, count, M, N, K, N, N, r.stride(0), K, K, K, K, PDL=True,
                                BLOCK_N=256, launch_pdl=True, **cfg)


def sweep(progress) -> list[dict]:
    rows = []
    for K, N in SWEEP_SHAPES:
        x = torch.randn(BATCH, K, device="cuda").to(torch.bfloat16)
        w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        dy = torch.randn(BATCH, N, device="cuda").to(torch.bfloat16)
        _, u, r = mods_forward_ref(x.float() @ w.float().t(), 256, 1e-6)
        dz_of = lambda: triton_mods.backward_dz(dy, u, r, block=256)  # noqa: E731
        dz = dz_of()
        row = {"K": K, "N": N, "dz_kernel": graph_us(dz_of), "dgrad_cublas": graph_us(lambda: dz @ w),
               "wgrad_cublas": graph_us(lambda: dz.t() @ x),
               "unfused_in_order": graph_us(lambda: (lambda d: (d @ w, d.t() @ x))(dz_of())),
               "unfused_two_streams": graph_us(
                   lambda: (lambda d: side_by_side(lambda: d @ w, lambda: d.t() @ x, dy.device))(dz_of())),
               "configs": []}
        for bm, bk, rw, splits, warps in SWEEP_CONFIGS:
            cfg = dict(BLOCK_M=bm, BLOCK_K=bk, ROWS_W=rw, M_SPLITS=splits, num_warps=warps, num_stages=2)
            progress.set_postfix_str(f"sweep ({K},{N}) {cfg}")
            one = graph_us(lambda: triton_mods_bwd.backward_one_kernel(dy, u, r, x, w, block=256, config=cfg))
            row["configs"].append({**cfg, "one_kernel_us": one, "dx_programs_only_us":
                                   graph_us(_dx_programs_only(dy, u, r, x, w, cfg))})
        rows.append(row)
        progress.update(1)
    return rows


def geomean_vs_base(rows: list[dict], variant: str) -> float:
    t = {(r["K"], r["N"], r["variant"]): r.get("graph_us") for r in rows}
    return math.exp(sum(math.log(t[(K, N, "base_eager")] / t[(K, N, variant)]) for K, N in FIG13_SHAPES)
                    / len(FIG13_SHAPES))


def plot(sweep_rows: list[dict], fig13_rows: list[dict], path: Path, device: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    for i, row in enumerate(sweep_rows):
        xs = [c["M_SPLITS"] for c in row["configs"][:5]]
        axes[0].plot(xs, [c["one_kernel_us"] for c in row["configs"][:5]], "o-", label=f"one kernel ({row['K']}, "
                     f"{row['N']}), (32, 64, 32, S, 4)", color=f"C{i}")
        axes[0].axhline(row["unfused_two_streams"], ls="--", color=f"C{i}",
                        label=f"dz + 2 cuBLAS GEMMs ({row['K']}, {row['N']})")
    axes[0].set(xscale="log", yscale="log", xlabel="M_SPLITS (dW row ranges summed with fp32 atomics)",
                ylabel="backward GPU µs (graph replay)", title="backward alone, batch 1024")
    axes[0].legend(fontsize=7)
    t = {(r["K"], r["N"], r["variant"]): r.get("graph_us") for r in fig13_rows}
    labels = [f"({K},{N})" for K, N in FIG13_SHAPES]
    for j, v in enumerate(["split_bf16", "split_bf16_no_one_kernel_bwd", "fused_fp8_fwd",
                           "fused_fp8_fwd_no_one_kernel_bwd"]):
        ys = [t[(K, N, "base_eager")] / t[(K, N, v)] for K, N in FIG13_SHAPES]
        axes[1].bar([i + 0.2 * j for i in range(len(ys))], ys, width=0.2, label=v)
    axes[1].set_xticks([i + 0.3 for i in range(len(labels))], labels, rotation=30, fontsize=8)
    axes[1].set(ylabel="× base (Linear+bias+LN+SiLU BF16 eager)", title="figure-13 layer fwd+bwd, one kernel forced")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"One-kernel BF16 backward vs dz + cuBLAS, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    triton_mods_bwd.MAX_WEIGHT_ELEMENTS = 10 ** 12  # forced at every shape, to see where it pays
    with tqdm(total=len(SWEEP_SHAPES) + len(FIG13_SHAPES)) as progress:
        sweep_rows = sweep(progress)
        fig13_rows = bench_dispatch_gpu.bench_fig13(FIG13_SHAPES, progress, only=set(FIG13_VARIANTS))
    device = torch.cuda.get_device_name()
    meta = {"date": str(datetime.date.today()), "device": device, "torch": torch.__version__, "batch": BATCH,
            "command": "python scripts/bench_one_kernel_bwd_gpu.py OUT_DIR"}
    result = {"meta": meta, "sweep": sweep_rows, "fig13": fig13_rows,
              "one_kernel_autotune": autotune_picks(triton_mods_bwd._kernel()),
              "geomean_vs_base": {v: geomean_vs_base(fig13_rows, v) for v in FIG13_VARIANTS[1:]}}
    (out / "one_kernel_bwd.json").write_text(json.dumps(result, indent=1))
    plot(sweep_rows, fig13_rows, out / "one_kernel_bwd.png", device)
    for row in sweep_rows:
        best = min(row["configs"], key=lambda c: c["one_kernel_us"])
        print(f"({row['K']},{row['N']}) backward alone µs: dz {row['dz_kernel']:.1f}, "
              f"dgrad {row['dgrad_cublas']:.1f}, "
              f"wgrad {row['wgrad_cublas']:.1f}, unfused two streams {row['unfused_two_streams']:.1f}, in order "
              f"{row['unfused_in_order']:.1f}; one kernel best {best['one_kernel_us']:.1f} "
              f"({best}), its dx programs alone {best['dx_programs_only_us']:.1f}")
    t = {(r["K"], r["N"], r["variant"]): r.get("graph_us") for r in fig13_rows}
    print("(in, out) | " + " | ".join(FIG13_VARIANTS))
    for K, N in FIG13_SHAPES:
        print(f"({K}, {N}) | " + " | ".join(f"{t[(K, N, v)]:.1f}" for v in FIG13_VARIANTS))
    for v, g in result["geomean_vs_base"].items():
        print(f"geomean × base: {v} {g:.3f}")


if __name__ == "__main__":
    main()
