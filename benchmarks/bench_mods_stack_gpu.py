"""A stack of dense layers (an MLP of a recommendation model), published vs LoKA, forward + backward.

    python -m benchmarks.bench_mods_stack_gpu OUT_DIR [--widths 1024 2048 2048 1024 512] [--batch 1024 4096]
        [--profile split_fp8 split_fp8_handoff]

Per batch size, the same MLP widths as
- ``base``: Linear(bias) -> LayerNorm -> SiLU per layer, BF16 (eager, and ``base_compiled``);
- ``mods_compiled``: no bias -> BlockNorm(256) -> Hard Swish in plain PyTorch under ``torch.compile``;
- ``fused_bf16`` / ``split_bf16``: ``FusedLinearMods`` per layer, BF16, forward as one Triton GEMM+epilogue
  kernel / as a cuBLAS GEMM + the Triton epilogue kernel (the default mode); Triton dz backward;
- ``fused_fp8`` / ``split_fp8``: every layer with an FP8 forward (rowwise; fused GEMM+epilogue kernel / cuBLAS
  ``_scaled_mm`` + the epilogue kernel) and FP8 dgrad (dz quantization fused into the dz kernel), BF16 wgrad;
- ``split_fp8_handoff``: the same, plus the FP8 handoff (``chain_fp8_handoffs``): each layer's epilogue also
  writes its output in e4m3, so the next layer skips its quantization pass (split emitters only, see there).
Times: GPU µs from CUDA-graph replay (``timing.cuda_graph_us``), and the launch-bound eager time separately.
``--profile VARIANT ...``: also the per-kernel GPU µs of one step of those variants (``torch.profiler``).
Parameters and inputs BF16; gradients are reset before each timed call (written, not accumulated, as in a
training step). Writes OUT_DIR/bench_mods_stack.json and .png and prints a ratio table last.
``--device cpu`` only builds every variant and runs one step (a functional check; no timing).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from loka_trainer.models.layers import mlp
from loka_trainer.arg_types import require_cuda
from loka_trainer.mods.transform import chain_fp8_handoffs, fuse_linear_mods
from scripts.plot_results import grouped_bars, pyplot

PUBLISHED = dict(bias=True, norm="layernorm", activation="silu", block_size=256)
MODS = dict(bias=False, norm="blocknorm", activation="hardswish", block_size=256)
FP8_DGRAD = dict(dgrad="scaled_mm_rowwise", wgrad="bf16")
# FusedLinearMods variants: name -> (the kernels of every layer, FP8 handoff between layers)
FUSED_STACKS = {
    "fused_bf16": (dict(mode="fused_bf16"), False),
    "split_bf16": (dict(mode="split_bf16"), False),
    "fused_fp8": (dict(mode="fused_fp8", **FP8_DGRAD), False),
    "split_fp8": (dict(mode="split_fp8", **FP8_DGRAD), False),
    "split_fp8_handoff": (dict(mode="split_fp8", **FP8_DGRAD), True),
}
NUM_VARIANTS = 3 + len(FUSED_STACKS)  # base, base_compiled, mods_compiled + the fused stacks


def _stack(widths: list[int], mods: dict, device) -> nn.Sequential:
    torch.manual_seed(0)
    return mlp(widths[0], widths[1:], **mods).to(device=device, dtype=torch.bfloat16)


def build_variants(widths: list[int], device, *, compile_: bool = True) -> dict[str, nn.Module]:
    """name -> module mapping (B, widths[0]) -> (B, widths[-1]); see the module docstring."""
    variants: dict[str, nn.Module] = {"base": _stack(widths, PUBLISHED, device)}
    if compile_:
        variants["base_compiled"] = torch.compile(_stack(widths, PUBLISHED, device), dynamic=False)
        variants["mods_compiled"] = torch.compile(_stack(widths, MODS, device), dynamic=False)
    for name, (kernels, handoff) in FUSED_STACKS.items():
        m = _stack(widths, MODS, device)
        fqns = [f for f, mod in m.named_modules() if isinstance(mod, nn.Linear)]
        fuse_linear_mods(m, kernels={f: kernels for f in fqns})
        if handoff:
            chain_fp8_handoffs(m)
        variants[name] = m
    return variants


def step_fn(model: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    return lambda: model(x).backward(dy)


def measure(widths: list[int], batch: int, progress, profile: tuple[str, ...] = ()) -> list[dict]:
    """One row per variant at this batch; variants named in ``profile`` also get ``kernels_us`` (kernel name ->
    GPU µs per step)."""
    from benchmarks.profile_mods_layers_gpu import kernel_times
    from scripts.bench_timing import time_row
    rows = []
    torch._dynamo.reset()
    x = torch.randn(batch, widths[0], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(batch, widths[-1], device="cuda", dtype=torch.bfloat16)
    for name, model in build_variants(widths, "cuda").items():
        progress.set_postfix_str(f"batch {batch} {name}")
        row = {"batch": batch, "widths": widths, "variant": name}
        time_row(row, step_fn(model, x, dy), [x, *model.parameters()])  # grads written fresh, as in training
        if name in profile:
            row["kernels_us"] = kernel_times(step_fn(model, x, dy), [x, *model.parameters()], steps=10)
        rows.append(row)
        progress.update(1)
    base = next((r["graph_us"] for r in rows if r["variant"] == "base" and "graph_us" in r), None)
    for r in rows:
        if base and "graph_us" in r:
            r["speedup_vs_base"] = base / r["graph_us"]
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'batch':>6} {'variant':<20} {'graph µs':>10} {'x base':>7} {'eager µs':>10}"]
    for r in rows:
        if "graph_us" not in r:
            lines.append(f"{r['batch']:>6} {r['variant']:<20} {r.get('error', 'error')[:60]}")
            continue
        lines.append(f"{r['batch']:>6} {r['variant']:<20} {r['graph_us']:10.1f} {r.get('speedup_vs_base', math.nan):7.2f} "
                     f"{r.get('eager_us', math.nan):10.1f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Bars of speedup vs ``base`` (graph replay) per variant, one group per batch size."""
    batches = sorted({r["batch"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = pyplot().subplots(figsize=(8, 4))
    grouped_bars(ax, [f"batch {b}" for b in batches],
                 {v: [next((r.get("speedup_vs_base", 0) for r in rows if r["batch"] == b and r["variant"] == v), 0)
                      for b in batches] for v in variants})
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("speedup vs base (graph replay)")
    ax.set_title(f"MLP {rows[0]['widths']}: forward + backward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--widths", nargs="+", type=int, default=[1024, 2048, 2048, 1024, 512])
    ap.add_argument("--batch", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--profile", nargs="*", default=[], metavar="VARIANT",
                    help="also record per-kernel GPU time of one step of these variants")
    args = ap.parse_args()
    if args.device == "cpu":  # functional check: every variant builds and runs one step
        x = torch.randn(args.batch[0], args.widths[0], dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.batch[0], args.widths[-1], dtype=torch.bfloat16)
        for name, model in build_variants(args.widths, "cpu", compile_=False).items():
            step_fn(model, x, dy)()
            print(f"{name}: ok")
        return
    require_cuda(ap, what="a CUDA GPU (or --device cpu for a functional check)")
    rows = []
    with tqdm(total=len(args.batch) * NUM_VARIANTS, desc="mods stack", unit="variant") as progress:
        for batch in args.batch:
            rows += measure(args.widths, batch, progress, tuple(args.profile))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": " ".join(sys.argv)}
    (args.out_dir / "bench_mods_stack.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out_dir / "bench_mods_stack.png")
    for r in rows:  # the profiled variants' largest kernels
        if "kernels_us" in r:
            top = sorted(r["kernels_us"].items(), key=lambda kv: -kv[1])[:8]
            print(f"batch {r['batch']} {r['variant']}: " + "; ".join(f"{k[:40]} {t:.1f}" for k, t in top))
    print(table(rows))


if __name__ == "__main__":
    main()
