"""GPU benchmark of LoKA Dispatch kernels (H200; torch 2.11 + triton; torchao / torchrec optional).

    python -m scripts.bench_dispatch_gpu OUT_DIR [--quick] [--suites a,b,c] [--mods-layer-variants v1,v2]
        [--mods-layer-shapes 7680x256 ...] [--mods-layer-forward-only] [--wukong-batch 4096] [--num-gemm-shapes N]
        [--accumulate-grads]

Suites (forward+backward unless said, GPU time from CUDA-graph replay with ``timing.cuda_graph_us``;
launch-bound eager time reported separately with ``triton.testing.do_bench``; gradients reset before every
timed call unless ``--accumulate-grads``; see ``scripts.bench_timing``):
(a) LRM GEMM shapes: the three GEMMs of one Linear (forward, input-grad, weight-grad), quantization
    included, per available backend vs BF16.
(b) Mods layers at the paper's figure-13 shapes (``MODS_LAYER_SHAPES``), batch 1024: Linear(bias)+LayerNorm+SiLU
    in BF16 (eager, compiled), the Mods in plain PyTorch compiled, torchao FP8 rowwise + Mods compiled, the fused
    Mods layer (``loka_trainer.mods.ops.linear_mods``: fused forward + fused dz backward; BF16 fused / split, FP8
    forward fused / split (``_scaled_mm`` + epilogue kernel), FP8 dgrad (rowwise or tensorwise) with dz's amax from
    the dz kernel, FP8 all three GEMMs), and an ablation (no-bias / BlockNorm / HardSwish one at a time, compiled).
    ``fused_best`` = the fastest fused variant per shape (what Dispatch picks by measuring). ``*_serial_grads``:
    the backward's two GEMMs in order instead of on two streams (``ModsKernelConfig(backward_streams=False)``;
    not candidates for fused_best).
    ``--mods-layer-forward-only``: the same variants' inference forward under ``torch.no_grad`` instead (suite
    ``mods_layer_fwd``; the paper's figure 13 reports latency, without saying whether backward is in it).
(c) The zoo's Wukong dense arch (default WukongConfig; dense MLP, interaction layers, over arch), forward +
    backward of ``logits.sum()``, compute only: the sparse embeddings are replaced by a fixed (B, F_s, D)
    tensor. BF16 = the published model (bias, LayerNorm, SiLU), eager and compiled; each uniform torchao
    recipe on the published model, compiled; Mods only (BF16, compiled); LoKA = Mods + Dispatch (plan built
    on this device from candidates bf16 / scaled_mm_rowwise / scaled_mm_tensorwise) + FusedLinearMods,
    compiled. Parameters and inputs in BF16. FP8 weights are cast once per weight version (no optimizer step
    happens inside the timed region, so the cast is not in it for LoKA eager; under torch.compile it is).
Writes OUT_DIR/bench_dispatch.json (rows, geomeans, the targets, and with (b) the configs the fused forward kernel's
autotuner picked per key) and OUT_DIR/bench_dispatch.png; prints a ratio table last.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from loka_trainer.arg_types import feature_pair, positive_int, require_cuda, writable_dir
from loka_trainer.kernels.backends import available_backends
from loka_trainer.kernels.linear import weight_caches
from loka_trainer.mods.triton_mods import autotune_picks
from scripts.bench_targets import target_lines
from scripts.bench_timing import both_ends, time_row
from scripts.mods_layer_variants import (
    BATCH, FUSED_VARIANTS, MODS_LAYER_SHAPES, build_mods_layer_variants, mods_layer_variant_names,
)
from scripts.provenance import provenance

GEMM_SHAPES = [(2048, 256, 768), (2048, 512, 512), (4096, 1024, 1024), (8192, 2048, 2048),
               (16384, 1024, 4096), (8192, 4096, 4096), (8192, 8192, 8192)]
MODS_LAYER_SUITES = ("mods_layer", "mods_layer_fwd")  # forward + backward (training), forward only (inference)


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
            fn = lambda be=be: (be.forward(x, w), be.input_grad(dy, w), be.weight_grad(dy, x))
            time_row(row, fn)  # a backend failing at one shape is reported, not fatal
            rows.append(row)
        progress.update(1)
    return rows


def _inference(f, x):
    """() -> f(x) under ``torch.no_grad`` (a forward-only step: nothing saved for backward)."""
    def call():
        with torch.no_grad():
            return f(x)
    return call


def bench_mods_layers(shapes, progress, only: Optional[set] = None, reset_grads: bool = True,
                forward_only: bool = False) -> list[dict]:
    """Suite (b): one Mods layer fwd+bwd at batch 1024 per variant and (K, N) shape (``only``: names to keep;
    ``reset_grads``: see ``time_row``'s grad_to_none). ``forward_only``: the inference forward instead (under
    ``torch.no_grad``), suite name ``mods_layer_fwd``."""
    rows = []
    suite = "mods_layer_fwd" if forward_only else "mods_layer"
    for K, N in shapes:
        torch._dynamo.reset()  # the lambdas share code objects across shapes: keep each shape's graphs fresh
        x = torch.randn(BATCH, K, device="cuda", dtype=torch.bfloat16, requires_grad=not forward_only)
        dy = torch.randn(BATCH, N, device="cuda", dtype=torch.bfloat16)
        variants, params = build_mods_layer_variants(K, N, only)
        for name, f in variants.items():
            progress.set_postfix_str(f"{suite} ({K},{N}) {name}")
            row = {"suite": suite, "M": BATCH, "K": K, "N": N, "variant": name}
            step = _inference(f, x) if forward_only else (lambda f=f: f(x).backward(dy))
            time_row(row, step, [x, *params] if reset_grads and not forward_only else None)
            rows.append(row)
        progress.update(1)
    return rows


def add_fused_best(rows: list[dict]) -> None:
    """Append, per Mods layer suite and shape, a ``fused_best`` row: the fastest fused variant (Dispatch's choice).
    It copies that row's times but not its ``wall_s``: the per-suite wall time would count that variant twice."""
    for key in sorted({(r["suite"], r["M"], r["K"], r["N"]) for r in rows if r["suite"] in MODS_LAYER_SUITES}):
        fused = [r for r in rows if (r["suite"], r["M"], r["K"], r["N"]) == key
                 and r["variant"] in FUSED_VARIANTS and r.get("graph_us")]
        if fused:
            best = min(fused, key=lambda r: r["graph_us"])
            rows.append({**{k: v for k, v in best.items() if k != "wall_s"}, "variant": "fused_best",
                         "picked": best["variant"]})


class WukongDense(torch.nn.Module):
    """The Wukong model without its embeddings: dense (B, F_d) -> logits (B,), sparse tokens fixed (B, F_s, D)."""

    def __init__(self, model: torch.nn.Module, sparse_tokens: torch.Tensor) -> None:
        super().__init__()
        self.dense_arch, self.layers, self.over_arch = model.dense_arch, model.layers, model.over_arch
        self.register_buffer("sparse_tokens", sparse_tokens, persistent=False)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([self.dense_arch(dense), self.sparse_tokens], dim=1)  # (B, n_0, D)
        for layer in self.layers:
            tokens = layer(tokens)
        return self.over_arch(tokens.flatten(1))


def _wukong(batch: int, *, loka_mods: bool) -> tuple[WukongDense, torch.Tensor]:
    from loka_trainer.data.batch import DataSchema
    from loka_trainer.models.wukong import WukongConfig, build_wukong
    torch.manual_seed(0)
    names = tuple(f"c{i}" for i in range(26))
    schema = DataSchema(num_dense=13, sparse_features=names, sparse_vocab_sizes=(1000,) * 26)
    cfg = WukongConfig()
    model = build_wukong(cfg, schema=schema, loka_mods=loka_mods)
    sparse = torch.randn(batch, 26, cfg.embedding_dim, device="cuda", dtype=torch.bfloat16)
    dense = torch.randn(batch, 13, device="cuda", dtype=torch.bfloat16)
    return WukongDense(model, sparse).to(device="cuda", dtype=torch.bfloat16), dense


def _wukong_variants(batch: int, log) -> dict:
    """name -> (module, dense input, compile?) for suite (c)."""
    from loka_trainer.precision import PrecisionConfig, apply_precision
    v = {}
    m, d = _wukong(batch, loka_mods=False)
    v["bf16_eager"], v["bf16_compiled"] = (m, d, False), (m, d, True)
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        m, d = _wukong(batch, loka_mods=False)
        apply_precision(m, config=PrecisionConfig(name=f"fp8_{recipe}", fp8_recipe=recipe), device="cuda", log=log)
        v[f"torchao_{recipe}_compiled"] = (m, d, True)
    m, d = _wukong(batch, loka_mods=True)
    v["mods_bf16_compiled"] = (m, d, True)
    m, d = _wukong(batch, loka_mods=True)
    cfg = PrecisionConfig(name="loka", compute_dtype="bfloat16", mods=True, dispatch=True,
                          backends=["scaled_mm_rowwise", "scaled_mm_tensorwise"])
    apply_precision(m, config=cfg, device="cuda", calibration_batch=d, log=log)
    for cache in weight_caches(m):  # one weight version throughout: its FP8 casts serve every call, as between steps
        cache.reuse = True
    v["loka_eager"], v["loka_compiled"] = (m, d, False), (m, d, True)
    return v


def bench_wukong(batch: int, progress, reset_grads: bool = True) -> list[dict]:
    """Suite (c): Wukong dense arch fwd+bwd per variant (``reset_grads``: see ``time_row``)."""
    rows, logs = [], []
    try:
        variants = _wukong_variants(batch, logs.append)
    except Exception as e:
        return [{"suite": "wukong", "M": batch, "K": 0, "N": 0, "variant": "setup",
                 "error": f"{type(e).__name__}: {e}"[:300]}]
    for name, (m, d, compiled) in variants.items():
        progress.set_postfix_str(f"wukong {name}")
        f = torch.compile(m) if compiled else m
        row = {"suite": "wukong", "M": batch, "K": 0, "N": 0, "variant": name}
        time_row(row, lambda f=f, d=d: f(d).float().sum().backward(),
                 list(m.parameters()) if reset_grads else None)
        rows.append(row)
    rows.append({"suite": "wukong", "M": batch, "K": 0, "N": 0, "variant": "log", "log": logs})
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
        ax.set_title(f"{suite}: " + ("forward only (no_grad)" if suite == "mods_layer_fwd" else "fwd+bwd"))
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=writable_dir)
    p.add_argument("--quick", action="store_true", help="two shapes per suite")
    p.add_argument("--suites", default="a,b,c", help="comma-separated subset of a,b,c")
    p.add_argument("--mods-layer-variants", default="default",
                   help="(b): 'default' (the issue's comparisons and the fused modes that win somewhere), 'all', "
                        "or comma-separated variant names")
    p.add_argument("--wukong-batch", type=positive_int, default=4096)
    p.add_argument("--num-gemm-shapes", type=positive_int, default=len(GEMM_SHAPES), help="first N shapes of suite (a)")
    p.add_argument("--accumulate-grads", action="store_true",
                   help="(b), (c): keep adding into .grad across timed calls (as the runs recorded before "
                        "2026-11-30 did) instead of resetting it to None before each call as a training step does")
    p.add_argument("--mods-layer-shapes", nargs="+", type=feature_pair, default=None, metavar="INxOUT",
                   help="only these (in, out) shapes in (b), e.g. 7680x256 (default: MODS_LAYER_SHAPES)")
    p.add_argument("--mods-layer-forward-only", action="store_true",
                   help="(b): time the inference forward (torch.no_grad) instead of forward + backward")
    args = p.parse_args()
    try:
        only = set(mods_layer_variant_names(args.mods_layer_variants))
    except ValueError as e:
        raise SystemExit(f"bench_dispatch_gpu: {e}")
    # Every Mods layer shape recompiles the same lambdas: without this dynamo stops compiling after 8 and
    # silently runs them eagerly, which is what made "compiled" rows slow at the later shapes.
    torch._dynamo.config.cache_size_limit = 512
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 512
    require_cuda(p)
    suites = set(args.suites.split(","))
    gemm_shapes = (GEMM_SHAPES[:2] if args.quick else GEMM_SHAPES[:args.num_gemm_shapes]) if "a" in suites else []
    layer_shapes = (MODS_LAYER_SHAPES[:2] if args.quick else MODS_LAYER_SHAPES) if "b" in suites else []
    if args.mods_layer_shapes and "b" in suites:
        layer_shapes = list(args.mods_layer_shapes)
    rows = []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    partial = args.out_dir / "bench_dispatch.partial.json"  # survives a run cut short by a time limit
    with tqdm(total=len(gemm_shapes) + len(layer_shapes) + ("c" in suites), desc="bench_dispatch") as progress:
        for shape in layer_shapes:  # saved per shape: a run cut short keeps the shapes it measured
            rows += bench_mods_layers([shape], progress, only, reset_grads=not args.accumulate_grads,
                                      forward_only=args.mods_layer_forward_only)
            partial.write_text(json.dumps(rows))
        if "c" in suites:
            rows += bench_wukong(args.wukong_batch, progress, reset_grads=not args.accumulate_grads)
            partial.write_text(json.dumps(rows))
        rows += bench_gemms(gemm_shapes, progress)
    add_fused_best(rows)
    add_ratios(rows, {"gemm": "bf16", "mods_layer": "base_eager", "mods_layer_fwd": "base_eager",
                      "wukong": "bf16_compiled"})
    result = {**provenance(), "rows": rows,
              "geomean_speedup": geomeans(rows), "targets": target_lines(rows)}
    if layer_shapes:  # which of the fused forward kernel's configs won where (to prune the list with data)
        result["fused_forward_autotune"] = autotune_picks()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_dispatch.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out_dir / "bench_dispatch.png")
    print(f"\n{'suite':<14} {'M×K×N':>17} {'variant':<30} {'graph µs':>9} {'eager µs':>9} {'speedup':>8}")
    for r in rows:
        if r["variant"] == "log":
            print("\n".join(r["log"]))
            continue
        g, e, s = r.get("graph_us"), r.get("eager_us"), r.get("speedup")
        print(f"{r['suite']:<14} {r['M']}×{r['K']}×{r['N']:<7} {r['variant']:<30} "
              f"{g or float('nan'):>9.1f} {e or float('nan'):>9.1f} {s or float('nan'):>8.2f}"
              + (f"  {r['error'][:60]}" if "error" in r else ""))
    errs = [r for r in rows if "graph_error" in r]
    if errs:  # cuda_graph_us capture failures (the fallback timer was used): show the first one
        print(f"{len(errs)} row(s) used the fallback graph timer; first ({errs[0]['variant']}):")
        print(both_ends(errs[0]["graph_error"], 900))
    for suite, gm in result["geomean_speedup"].items():
        print(f"geomean speedup ({suite}): " + ", ".join(f"{k} {v:.2f}x" for k, v in sorted(gm.items())))
    wall = {suite: sum(r.get("wall_s", 0) for r in rows if r["suite"] == suite) for suite in result["geomean_speedup"]}
    print("timing wall time per suite (s, compilation included): "
          + ", ".join(f"{suite} {s:.0f}" for suite, s in wall.items()))
    print("\n".join(result["targets"]))


if __name__ == "__main__":
    main()
