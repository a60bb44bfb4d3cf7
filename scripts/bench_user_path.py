"""The fused Mods layer as a user gets it: built with the public API, eager and compiled, against the published layer.

    python -m scripts.bench_user_path OUT [--batch 1024] [--shapes K,N ...] [--device cuda|cpu] [--kernels]
        [--best-of-modes] [--resume]

Per (K in, N out) shape (default: the paper's figure-13 layers), forward + backward of one layer (gradients set
to None before each call, as after ``zero_grad()``), timed by CUDA-graph replay on a GPU (``timing.cuda_graph_timer``:
GPU time without the host's launch cost; wall clock on CPU):

- ``published``: Linear(bias) -> LayerNorm -> SiLU in BF16, eager (the reference of every ratio) and compiled;
- ``mods_compiled``: the Mods in plain PyTorch, Linear(no bias) -> BlockNorm(256) -> Hardswish, compiled;
- ``loka_eager`` / ``loka_compiled``: that plain Mods block handed to ``convert_to_loka`` (Mods fusion + Dispatch,
  ``LoKAConfig(compile=...)`` matching how it then runs), exactly what a user's code does;
- ``loka_eager_cast_reused``: ``loka_eager`` with its FP8 weights cast once and reused by every call, as under
  gradient accumulation; every other variant casts them once per call, as a training step does after the
  optimizer's step (a graph captured on a cache hit replays no cast);
- ``loka_eager_plan_compiled``: ``loka_eager`` (the kernels Dispatch chose eager) compiled: what compiling costs
  the same kernels.

``--best-of-modes`` adds ``best_of_modes``: the fastest eager step over the fused layer's ``BEST_OF`` kernel
choices at each shape (FP8 ones included, their accuracy not checked, weight casts paid per call): what the kernels
can do, beside what Dispatch picks for a user (``scripts.bench_dispatch_gpu --suites b`` times more variants).

Prints each shape's µs and the geomean ratios (published eager / X) last; writes ``OUT/user_path.json`` and
``OUT/user_path.png``.

``--resume`` keeps the rows an interrupted run of the same code wrote and times only the other shapes.

``--kernels`` (CUDA): each row also lists the GPU kernels of one profiled step of each ``PROFILED`` variant (name,
µs, calls; ``scripts.kernel_split``), and the table ends with what ``loka_eager_plan_compiled`` runs beyond
``loka_eager`` (``kernel_diff``): where the same kernels lose time when compiled.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from loka_trainer.arg_types import feature_pair, positive_int, writable_dir
from loka_trainer import LoKAConfig, convert_to_loka
from loka_trainer.kernels.linear import weight_caches
from loka_trainer.mods.layers import BlockNorm
from loka_trainer.timing import cuda_graph_timer, wall_clock_timer
from scripts.plot_results import grouped_bars, pyplot
from scripts.provenance import provenance, source_digest
from scripts.result_files import previous_result
from scripts.mods_layer_variants import BATCH, DEFAULT_MODS_LAYER_VARIANTS, FUSED_VARIANTS, MODS_LAYER_SHAPES

VARIANTS = ("published", "published_compiled", "mods_compiled", "loka_eager", "loka_compiled",
            "loka_eager_cast_reused", "loka_eager_plan_compiled")
PROFILED = ("loka_eager", "loka_compiled", "loka_eager_plan_compiled", "mods_compiled")  # listed by --kernels
LOKA = ("loka_eager", "loka_compiled")  # the variants built by convert_to_loka, whose kernels a row records
# --best-of-modes: the fused layer's kernel choices that were the fastest at some figure-13 shape on the H200
BEST_OF = tuple(name for name in DEFAULT_MODS_LAYER_VARIANTS if name in FUSED_VARIANTS)


def published(K: int, N: int) -> nn.Module:
    return nn.Sequential(nn.Linear(K, N), nn.LayerNorm(N), nn.SiLU())


def plain_mods(K: int, N: int, block: int = 256) -> nn.Module:
    return nn.Sequential(nn.Linear(K, N, bias=False), BlockNorm(N, block), nn.Hardswish())


def training_step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor, *, new_weights: bool = True
                  ) -> Callable[[], None]:
    """One forward + backward, gradients written fresh (x (M, K) a leaf that requires grad, dy (M, N));
    ``new_weights``: the LoKA layers' FP8 weight caches are cleared first, as the optimizer's step does; else they
    reuse their operands across calls, as between the steps of an optimizer ``register_weight_cache_hook`` ties
    them to."""
    params = [p for p in model.parameters()]
    caches = weight_caches(model) if new_weights else []
    if not new_weights:
        for cache in weight_caches(model):
            cache.reuse = True

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        for cache in caches:
            cache.clear()
        model(x).backward(dy)
    return step


def chosen_kernels(model: nn.Module) -> dict[str, str]:
    """The fused layer's kernels as Dispatch set them (forward mode, dgrad and wgrad backends); all "unfused"
    when the shape was not fused (N not a multiple of the block)."""
    from loka_trainer.mods.module import FusedLinearMods
    layer = next((m for m in model.modules() if isinstance(m, FusedLinearMods)), None)
    if layer is None:
        return dict.fromkeys(("mode", "dgrad", "wgrad"), "unfused")
    return {"mode": layer.mode, "dgrad": layer.dgrad, "wgrad": layer.wgrad}


def best_of_modes(mods: nn.Module, x: torch.Tensor, dy: torch.Tensor, timer) -> tuple[float, str]:
    """(µs, name) of the fastest eager training step over ``BEST_OF`` (``FUSED_VARIANTS``' kernels) of the fused
    layer made from ``mods`` (Linear, BlockNorm, Hardswish; its weight shared) at x (M, K), dy (M, N); a choice
    that raises at this shape is skipped."""
    from loka_trainer.mods.module import FusedLinearMods
    times = {}
    for name in BEST_OF:
        layer = FusedLinearMods.from_linear(mods[0], mods[1], **FUSED_VARIANTS[name])
        try:
            times[name] = timer(training_step(layer, x, dy))
        except RuntimeError:
            continue
    best = min(times, key=times.__getitem__)
    return times[best], best


def layer_times(K: int, N: int, *, batch: int, device: torch.device, timer, profile_kernels: bool = False,
                best_of: bool = False) -> tuple[dict[str, float], dict, dict]:
    """(µs of each variant's training step at x (batch, K), the kernels Dispatch chose eager and compiled (with
    ``dispatch_us``: its own step µs of each forward mode it weighed, per layer; on CPU, where Dispatch times no
    forward modes, {}), and under ``profile_kernels`` the GPU kernels of one step of each ``PROFILED`` variant,
    else {}). ``best_of``: the µs also hold ``best_of_modes``, the kernels its choice (``{"variant": name}``)."""
    dtype = torch.bfloat16
    x = torch.randn(batch, K, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(batch, N, device=device, dtype=dtype)
    base = published(K, N).to(device, dtype)
    mods = plain_mods(K, N).to(device, dtype)
    models = {"published": base, "published_compiled": torch.compile(copy.deepcopy(base)),
              "mods_compiled": torch.compile(copy.deepcopy(mods))}
    timed = {}  # Dispatch's own step times (µs) of each forward mode it weighed, eager and compiled
    for name, compiled in (("loka_eager", False), ("loka_compiled", True)):
        user = copy.deepcopy(mods)
        config = LoKAConfig(compute_dtype="bfloat16", mods=True, dispatch=True, min_features=16, compile=compiled)
        plan = convert_to_loka(user, config, calibration_batch=x.detach(), device=device, log=lambda _: None)
        models[name] = torch.compile(user) if compiled else user
        timed[name] = {fqn: lp.mods_forward.times_us for fqn, lp in plan.layers.items() if lp.mods_forward}
    models["loka_eager_plan_compiled"] = torch.compile(copy.deepcopy(models["loka_eager"]))
    steps = {name: training_step(model, x, dy) for name, model in models.items()}
    steps["loka_eager_cast_reused"] = training_step(models["loka_eager"], x, dy, new_weights=False)
    kernels = {name: {**chosen_kernels(models[name]), "dispatch_us": timed[name]} for name in LOKA}
    us = {name: timer(steps[name]) for name in VARIANTS}
    if best_of:
        us["best_of_modes"], best = best_of_modes(mods, x, dy, timer)
        kernels["best_of_modes"] = {"variant": best}
    profiled = {}
    if profile_kernels:
        from scripts.kernel_split import kernel_split_ms
        profiled = {name: kernel_split_ms(steps[name])["top_kernels"] for name in PROFILED}
    return us, kernels, profiled


def kernel_diff(before: list, after: list) -> list:
    """Kernels of ``after`` beyond ``before``: each kernel list is [[name, µs, calls], ...] (one profiled step);
    returns [[name, extra µs, extra calls], ...] for every name ``after`` launches more often or longer, the largest
    extra time first."""
    had = {name: (us, calls) for name, us, calls in before}
    extra = []
    for name, us, calls in after:
        us0, calls0 = had.get(name, (0.0, 0))
        if calls > calls0 or us > us0:
            extra.append([name, round(us - us0, 1), calls - calls0])
    return sorted(extra, key=lambda k: -k[1])


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def columns(rows: list[dict]) -> list[str]:
    """``VARIANTS``, then ``best_of_modes`` when every row has it."""
    return [*VARIANTS, *(["best_of_modes"] if all("best_of_modes" in r["us"] for r in rows) else [])]


def summarize(rows: list[dict]) -> dict[str, float]:
    """Geomean over shapes of published-eager time / each column's time (> 1: faster than the published layer)."""
    return {name: geomean([r["us"]["published"] / r["us"][name] for r in rows]) for name in columns(rows)}


def plot(rows: list[dict], summary: dict[str, float], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(9, 4))
    grouped_bars(ax, [f"{r['K']}x{r['N']}" for r in rows],
                 {f"{name} (geomean {summary[name]:.2f}x)": [r["us"]["published"] / r["us"][name] for r in rows]
                  for name in columns(rows)})
    ax.set_ylabel("x published layer (eager)")
    ax.axhline(1.0, color="gray", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def resumed_rows(path: Path, batch: int, source: str) -> list[dict]:
    """The rows an interrupted run left at ``path``; [] when there is none. Rows of other code than ``source``
    (``provenance.source_digest``) or of another batch are refused with the reason: a table mixes no two versions
    of the code."""
    done = previous_result(path, keys=("rows",))
    if done is None:
        return []
    if done.get("source") != source or done.get("batch") != batch:
        raise SystemExit(f"{path}: rows of source {done.get('source')} batch {done.get('batch')}, this run is "
                         f"source {source} batch {batch}; move the file away to start afresh")
    return done["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=writable_dir)
    ap.add_argument("--batch", type=positive_int, default=BATCH)
    ap.add_argument("--shapes", nargs="+", type=feature_pair, default=list(MODS_LAYER_SHAPES), metavar="INxOUT")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--kernels", action="store_true", help="list each step's GPU kernels (CUDA only)")
    ap.add_argument("--best-of-modes", action="store_true", help="also time the fastest fused kernel choice eager")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows OUT/user_path.json already has (same code and batch) and time only the rest")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this machine has no CUDA device")
    if args.kernels and device.type != "cuda":
        ap.error("--kernels profiles GPU kernels: it needs --device cuda")
    timer = cuda_graph_timer() if device.type == "cuda" else wall_clock_timer(repeats=3, warmup=1)
    args.out.mkdir(parents=True, exist_ok=True)
    source = source_digest()  # the code these rows are of (a resumed run refuses rows of other code)
    rows = resumed_rows(args.out / "user_path.json", args.batch, source) if args.resume else []
    for K, N in args.shapes:
        if any((r["K"], r["N"]) == (K, N) for r in rows):
            continue
        torch._dynamo.reset()
        us, kernels, profiled = layer_times(K, N, batch=args.batch, device=device, timer=timer,
                                            profile_kernels=args.kernels, best_of=args.best_of_modes)
        rows.append({"K": K, "N": N, "us": us, "kernels": kernels, **({"gpu_kernels": profiled} if profiled else {})})
        partial = {"device": str(device), "source": source, "batch": args.batch, "rows": rows}
        (args.out / "user_path.json").write_text(json.dumps(partial, indent=2))
    summary = summarize(rows)
    result = {**provenance(), "batch": args.batch, "rows": rows, "geomean_vs_published": summary}
    (args.out / "user_path.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, summary, args.out / "user_path.png")
    shown = columns(rows)
    print("shape        " + "  ".join(f"{v:>18}" for v in shown))
    for r in rows:
        picked = " | ".join(f"{k['mode']},{k['dgrad']},{k['wgrad']}" for k in (r["kernels"][n] for n in LOKA))
        best = f" | best: {r['kernels']['best_of_modes']['variant']}" if "best_of_modes" in shown else ""
        print(f"{r['K']:>5}x{r['N']:<6} " + "  ".join(f"{r['us'][v]:>16.1f}us" for v in shown) + f"  {picked}{best}")
    for r in rows:
        for name in LOKA:
            for us in r["kernels"][name]["dispatch_us"].values():
                print(f"{r['K']}x{r['N']} {name} Dispatch's step µs: " + ", ".join(
                    f"{m} {t:.1f}" for m, t in us.items() if t is not None))
    for r in rows if args.kernels else []:
        extra = kernel_diff(r["gpu_kernels"]["loka_eager"], r["gpu_kernels"]["loka_eager_plan_compiled"])
        listed = "; ".join(f"{n[:60]} +{us:.1f}us x{c:+d}" for n, us, c in extra[:4]) or "nothing"
        print(f"{r['K']}x{r['N']} the eager plan compiled, beyond eager: {listed}")
    print("geomean x published: " + ", ".join(f"{v} {summary[v]:.2f}x" for v in shown))
    print(f"LoKA compiled / plain Mods compiled: {summary['loka_compiled'] / summary['mods_compiled']:.2f}x")


if __name__ == "__main__":
    main()
