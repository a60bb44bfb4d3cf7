"""GPU benchmark of LoKA Dispatch kernels (H200; torch 2.11 + triton; torchao / fbgemm optional).

    python scripts/bench_dispatch_gpu.py OUT_DIR [--quick]

Suites (all forward+backward, GPU time from CUDA-graph replay with ``triton.testing.do_bench_cudagraph``;
launch-bound eager time reported separately with ``triton.testing.do_bench``):
(a) LRM GEMM shapes: the three GEMMs of one Linear (forward, input-grad, weight-grad), quantization
    included, per available backend vs BF16.
(b) The paper's figure-13 layers at batch 1024: Linear(bias)+LayerNorm+SiLU in BF16 (eager, compiled), the
    Mods in plain PyTorch compiled, torchao FP8 rowwise + Mods compiled, the fused Mods kernel (BF16 and FP8
    inputs), and an ablation (no-bias / BlockNorm / HardSwish one at a time, compiled).
Not yet: (c) the Wukong dense arch end to end.
Writes OUT_DIR/bench_dispatch.json and OUT_DIR/bench_dispatch.png; prints a ratio table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loka_trainer.kernels.backends import available_backends  # noqa: E402
from loka_trainer.kernels.mods_ref import block_norm, hard_swish  # noqa: E402

GEMM_SHAPES = [(2048, 256, 768), (2048, 512, 512), (4096, 1024, 1024), (8192, 2048, 2048),
               (16384, 1024, 4096), (8192, 4096, 4096), (8192, 8192, 8192)]
FIG13_SHAPES = [(256, 256), (7680, 256), (512, 512), (7680, 512), (4096, 2048), (4096, 2560), (2048, 4096),
                (2560, 4096), (256, 7680)]
BATCH = 1024


def graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    fn()  # warm up: autotune and compile outside the graph capture
    torch.cuda.synchronize()
    return 1e3 * float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


def eager_us(fn) -> float:
    from triton.testing import do_bench
    return 1e3 * float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def bench_gemms(shapes, progress) -> list[dict]:
    """Suite (a): per shape and backend, the three GEMMs of one Linear with quantization included."""
    rows = []
    backends = available_backends("cuda")
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / math.sqrt(K)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        for name, be in backends.items():
            progress.set_postfix_str(f"gemm {M}x{K}x{N} {name}")
            row = {"suite": "gemm", "M": M, "K": K, "N": N, "variant": name}
            if not be.supports(M, K, N):
                continue
            try:
                fn = lambda be=be: (be.forward(x, w), be.input_grad(dy, w), be.weight_grad(dy, x))
                row["graph_us"] = graph_us(fn)
                row["eager_us"] = eager_us(fn)
            except Exception as e:  # a backend failing at one shape is reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
        progress.update(1)
    return rows


def _fig13_variants(K: int, N: int) -> dict:
    """name -> (module-free forward fn(x, params) -> y, params dict, compile?) for one figure-13 layer."""
    dev, bf = "cuda", torch.bfloat16
    w = (torch.randn(N, K, device=dev, dtype=bf) / math.sqrt(K)).requires_grad_()
    b = torch.zeros(N, device=dev, dtype=bf, requires_grad=True)
    ln_w = torch.ones(N, device=dev, dtype=bf, requires_grad=True)
    ln_b = torch.zeros(N, device=dev, dtype=bf, requires_grad=True)
    base = lambda x: F.silu(F.layer_norm(F.linear(x, w, b), (N,), ln_w, ln_b))
    no_bias = lambda x: F.silu(F.layer_norm(F.linear(x, w), (N,), ln_w, ln_b))
    bnorm = lambda x: F.silu(block_norm(F.linear(x, w, b)))
    hswish = lambda x: hard_swish(F.layer_norm(F.linear(x, w, b), (N,), ln_w, ln_b))
    mods = lambda x: hard_swish(block_norm(F.linear(x, w)))
    v = {"base_eager": base, "base_compiled": torch.compile(base), "mods_compiled": torch.compile(mods),
         "ablate_no_bias": torch.compile(no_bias), "ablate_blocknorm": torch.compile(bnorm),
         "ablate_hardswish": torch.compile(hswish)}
    try:
        from loka_trainer.kernels.triton_mods import linear_mods
        if K % 16 == 0 and N % 256 == 0:
            v["fused_mods_bf16"] = lambda x: linear_mods(x, w)
            v["fused_mods_fp8"] = lambda x: linear_mods(x, w, fp8=True)
    except ImportError:
        pass
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        lin = torch.nn.Linear(K, N, bias=False, device=dev, dtype=bf)
        seq = convert_to_float8_training(torch.nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name("rowwise"))
        v["torchao_rowwise_mods_compiled"] = torch.compile(lambda x: hard_swish(block_norm(seq(x))))
    except ImportError:
        pass
    return v


def bench_fig13(shapes, progress) -> list[dict]:
    """Suite (b): one figure-13 layer fwd+bwd at batch 1024 per variant."""
    rows = []
    for K, N in shapes:
        x = torch.randn(BATCH, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(BATCH, N, device="cuda", dtype=torch.bfloat16)
        for name, f in _fig13_variants(K, N).items():
            progress.set_postfix_str(f"fig13 ({K},{N}) {name}")
            row = {"suite": "fig13", "M": BATCH, "K": K, "N": N, "variant": name}
            step = lambda f=f: f(x).backward(dy)
            try:
                row["graph_us"] = graph_us(step)
                row["eager_us"] = eager_us(step)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
        progress.update(1)
    return rows


def add_ratios(rows: list[dict], baseline: dict[str, str]) -> None:
    """speedup = baseline graph time / variant graph time at the same suite and shape."""
    base = {(r["suite"], r["M"], r["K"], r["N"]): r.get("graph_us") for r in rows
            if r["variant"] == baseline[r["suite"]]}
    for r in rows:
        b = base.get((r["suite"], r["M"], r["K"], r["N"]))
        r["speedup"] = b / r["graph_us"] if b and r.get("graph_us") else None


def geomeans(rows: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for suite in sorted({r["suite"] for r in rows}):
        by: dict[str, list[float]] = {}
        for r in rows:
            if r["suite"] == suite and r.get("speedup"):
                by.setdefault(r["variant"], []).append(math.log(r["speedup"]))
        out[suite] = {v: math.exp(sum(s) / len(s)) for v, s in by.items()}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    suites = sorted({r["suite"] for r in rows})
    fig, axes = plt.subplots(1, len(suites), figsize=(8 * len(suites), 5), squeeze=False)
    for ax, suite in zip(axes[0], suites):
        sub = [r for r in rows if r["suite"] == suite and r.get("speedup")]
        shapes = sorted({(r["M"], r["K"], r["N"]) for r in sub})
        variants = sorted({r["variant"] for r in sub})
        width = 0.8 / max(len(variants), 1)
        for i, v in enumerate(variants):
            ys = [next((r["speedup"] for r in sub if r["variant"] == v and (r["M"], r["K"], r["N"]) == s), 0)
                  for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=v)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 for j in range(len(shapes))], [f"{m}x{k}x{n}" for m, k, n in shapes],
                      rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("speedup vs baseline (graph replay)")
        ax.set_title(f"{suite}: fwd+bwd")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--quick", action="store_true", help="two shapes per suite")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dispatch_gpu: needs a CUDA device")
    gemm_shapes = GEMM_SHAPES[:2] if args.quick else GEMM_SHAPES
    fig_shapes = FIG13_SHAPES[:2] if args.quick else FIG13_SHAPES
    with tqdm(total=len(gemm_shapes) + len(fig_shapes), desc="bench_dispatch") as progress:
        rows = bench_gemms(gemm_shapes, progress) + bench_fig13(fig_shapes, progress)
    add_ratios(rows, {"gemm": "bf16", "fig13": "base_eager"})
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": " ".join(sys.argv), "rows": rows, "geomean_speedup": geomeans(rows)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_dispatch.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_dispatch.png")
    print(f"\n{'suite':<6} {'M×K×N':>17} {'variant':<30} {'graph µs':>9} {'eager µs':>9} {'speedup':>8}")
    for r in rows:
        g, e, s = r.get("graph_us"), r.get("eager_us"), r.get("speedup")
        print(f"{r['suite']:<6} {r['M']}×{r['K']}×{r['N']:<7} {r['variant']:<30} "
              f"{g or float('nan'):>9.1f} {e or float('nan'):>9.1f} {s or float('nan'):>8.2f}"
              + (f"  {r['error'][:60]}" if "error" in r else ""))
    for suite, gm in result["geomean_speedup"].items():
        print(f"geomean speedup ({suite}): " + ", ".join(f"{k} {v:.2f}x" for k, v in sorted(gm.items())))


if __name__ == "__main__":
    main()
