"""End-to-end training-step and inference throughput of zoo models per precision, measured side by side.

    python -m scripts.bench_e2e_gpu OUT_DIR [--models wukong interformer] [--batch 4096] [--steps 20]
        [--vocab 100000] [--precisions bf16 fp8_tensorwise fp8_rowwise fp8_rowwise_gw_hp loka]
        [--no-compile | --compile-mode reduce-overhead] [--budget-s 240] [--in-process]

One device; each variant in its own process, as a user runs one precision (``--in-process``: all in this one, one
after another, where each variant starts with whatever the ones before it left allocated, ``leftover_mem_gib``).
Each variant builds the zoo model at its paper-size defaults (the dataclass defaults, e.g. `WukongConfig()`) or,
for a name like `wukong_h200`, at the sizes of `conf/model/wukong_h200.yaml`, on the synthetic planted-teacher data
(`data.max_vocab_size=100000`), with **unsharded** TorchRec embeddings (plain `EmbeddingBagCollection` /
`EmbeddingCollection`: multi-GPU TorchRec sharding is not part of this measurement),
then applies the precision exactly as `train.py` does (`apply_precision`; `loka` also builds the model with the
LoKA Mods, as `precision=loka` does; `P+mods`, e.g. `bf16+mods`, is precision P on the model with the Mods, which
separates the Mods from Dispatch; `loka+graph_timed` has Dispatch time its candidates by CUDA-graph replay,
`fp8_tensorwise+auto_filter` converts only the Linears torchao's own size filter keeps: ``VARIANT_SUFFIXES``). The
dense units (`model.dense_units()`) are compiled with `torch.compile` unless `--no-compile`. A training step =
forward under BF16 autocast, BCE loss, backward, fused Adam on the dense parameters and SGD on the embeddings
(dense embedding gradients: unsharded TorchRec modules have no fused TBE optimizer here); inference = forward only
under `torch.no_grad`. Times are CUDA-event wall times over `--steps` steps after warm-up (this is what a training
loop pays, launch overhead included), and one profiled step splits GPU kernel time into GEMM, FP8 quantization, our
Mods epilogue, attention and other kernels (the paper's figure-11 view, by kernel name: ``scripts.kernel_split``)
and records the graph breaks dynamo saw; one more step after warm-up gives the training step's peak GPU memory
(``train_peak_mem_gib``: ``max_memory_allocated`` after ``reset_peak_memory_stats``, parameters and optimizer
states included, and under ``--in-process`` anything left over from the variants before it, which
``leftover_mem_gib`` shows; ``train_peak_reserved_gib``: what the caching allocator held), and one forward what it
keeps for the backward, FP8 weight caches among it (``forward_memory``). Writes OUT_DIR/bench_e2e.json (after every
variant; each variant's process its own under OUT_DIR/variants/), OUT_DIR/plans/<model>_<precision>/
dispatch_plan.json (Dispatch variants: every candidate's MERE and time) and OUT_DIR/bench_e2e.png; prints a ratio
table last. Variants not started before --budget-s are skipped and listed as such.
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

from loka_trainer.arg_types import non_negative_int, positive_int, require_cuda, writable_dir
from loka_trainer import register_weight_cache_hook
from loka_trainer.kernels.linear import weight_caches
from loka_trainer.bench.profilers import cuda_peak_memory
from loka_trainer.data import DataConfig, build_stream, data_schema
from loka_trainer.dispatch.compile import reserve_compile_cache
from loka_trainer.models.configs import preset_config
from loka_trainer.models.zoo import MODELS, build_model
from loka_trainer.precision import PrecisionConfig, apply_precision
from loka_trainer.sharding.parallelize import embedding_modules
from loka_trainer.profiling.kernels import CATEGORIES
from scripts.kernel_split import kernel_split_ms
from scripts.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]  # the repository: its conf/ holds the precision and model presets

GIB = 2**30


# Variant suffixes: "<preset>+<suffix>..." is the preset with these changes (e.g. "bf16+mods": BF16 on the model
# built with the LoKA Mods; "loka+graph_timed": LoKA with Dispatch timing candidates by CUDA-graph replay;
# "loka+all_targets": Dispatch may convert the Linears the model declares BF16 too, as it did before they were).
VARIANT_SUFFIXES: dict[str, dict[str, object]] = {"mods": {"mods": True}, "graph_timed": {"gpu_timer": "cuda_graph"},
                                                   "auto_filter": {"fp8_filter": "auto"},
                                                   "all_targets": {"keep_declared_bf16": False}}


def precision_config(name: str) -> PrecisionConfig:
    """``<preset>[+<suffix>...]`` -> conf/precision/<preset>.yaml as a PrecisionConfig with ``VARIANT_SUFFIXES``
    applied."""
    preset, *suffixes = name.split("+")
    unknown = [x for x in suffixes if x not in VARIANT_SUFFIXES]
    if unknown:
        raise SystemExit(f"--precisions {name!r}: unknown suffix {unknown}; valid: {sorted(VARIANT_SUFFIXES)}")
    raw = OmegaConf.load(ROOT / "conf" / "precision" / f"{preset}.yaml")
    raw.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig), raw))
    for suffix in suffixes:
        for field, value in VARIANT_SUFFIXES[suffix].items():
            setattr(cfg, field, value)
    return cfg.validate()


def model_config(name: str):
    """A zoo name (``wukong``: its schema defaults, paper-like) or a ``conf/model/<name>.yaml`` file name
    (``wukong_h200``) -> the model config object."""
    if name in MODELS:
        return MODELS[name].config_cls()
    try:
        return preset_config(name)
    except ValueError as exc:
        raise SystemExit(f"--models: {name!r} is not a zoo model {sorted(MODELS)}; {exc}") from None


def build_variant(model_name: str, precision: str, *, batch: int, device: torch.device, compile_dense: bool,
                  vocab: int = DataConfig.max_vocab_size, shard_dense=None, compile_mode: Optional[str] = None,
                  plan_dir: Optional[Path] = None):
    """(model, sample batch on device, [dense Adam, embedding SGD], log lines) for one variant;
    ``model_name`` as in ``model_config``; ``shard_dense(model)``, when given, runs after the precision
    transform and before compiling; a Dispatch plan is written to ``plan_dir/dispatch_plan.json`` when given."""
    # Each variant builds new modules running the same forward code: without a reset, dynamo's per-code
    # cache fills up across variants, hits its recompile limit and silently runs later variants eagerly.
    torch._dynamo.reset()
    model_cfg = model_config(model_name)
    data_cfg = DataConfig(batch_size=batch, num_sequences=getattr(model_cfg, "num_sequences", 0), prefetch=0,
                          max_vocab_size=vocab)
    sample = next(iter(build_stream(data_cfg, split="eval", rank=0, world_size=1))).to(device)
    pcfg = precision_config(precision)
    torch.manual_seed(0)
    model = build_model(model_cfg, schema=data_schema(data_cfg), loka_mods=pcfg.mods)
    logs: list[str] = []
    model = model.to(device)
    apply_precision(model, config=pcfg, device=device, calibration_batch=sample, log=logs.append, run_dir=plan_dir)
    if shard_dense is not None:
        shard_dense(model)
    if compile_dense:
        reserve_compile_cache(model, logs.append)  # one compiled graph per distinct LoKA layer plan
        for unit in model.dense_units():
            unit.compile(mode=compile_mode)
    sparse = [p for _, m in embedding_modules(model) for p in m.parameters()]
    sparse_ids = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in sparse_ids]
    opts = [torch.optim.Adam(dense, lr=1e-3, fused=True), torch.optim.SGD(sparse, lr=0.01)]
    register_weight_cache_hook(model, opts[0])  # the cached FP8 weights follow the dense optimizer's steps
    return model, sample, opts, logs


def train_step(model, batch, opts) -> None:
    torch.compiler.cudagraph_mark_step_begin()  # --compile-mode reduce-overhead: a new step, old outputs are free
    with torch.autocast(batch.labels.device.type, dtype=torch.bfloat16):
        logits = model(batch).float()
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def forward_memory(model, batch, device) -> dict:
    """What one training forward keeps until its backward, on CUDA (GiB; None elsewhere): ``forward_kept_gib``, the
    memory allocated by the forward and still held after it (saved activations, outputs, FP8 operands), and
    ``fp8_weight_cache_gib``, the part held by LoKA's per-step FP8 weight caches (``WeightCache.nbytes``). The
    graph is dropped without a backward and the caches cleared, so the next step starts as after an optimizer step."""
    if device.type != "cuda":
        return {"forward_kept_gib": None, "fp8_weight_cache_gib": None}
    caches = weight_caches(model)
    for cache in caches:
        cache.clear()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = F.binary_cross_entropy_with_logits(model(batch).float(), batch.labels)
    torch.cuda.synchronize(device)
    out = {"forward_kept_gib": (torch.cuda.memory_allocated(device) - before) / GIB,
           "fp8_weight_cache_gib": sum(c.nbytes for c in caches) / GIB}
    del loss
    for cache in caches:
        cache.clear()
    return out


@torch.no_grad()
def infer_step(model, batch) -> None:
    torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(batch.labels.device.type, dtype=torch.bfloat16):
        model(batch)


def timed_ms(fn, steps: int, warmup: int, device_type: str = "cuda") -> float:
    """Mean ms per call of ``fn`` after ``warmup`` calls: CUDA events, or wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    if device_type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def dynamo_summary(top: int = 5) -> dict:
    """Graph breaks (count and the most frequent reasons) and compiled graphs since the last counters reset:
    a graph break in a dense unit means Python between graphs, i.e. launch-bound host time."""
    from torch._dynamo.utils import counters

    breaks = sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])
    return {"graph_breaks": sum(n for _, n in breaks), "graph_break_reasons": [[r[:200], n] for r, n in breaks[:top]],
            "unique_graphs": counters["stats"].get("unique_graphs", 0)}


def measure(model_name: str, precision: str, args, device) -> dict:
    from torch._dynamo.utils import counters

    row = {"model": model_name, "precision": precision, "batch": args.batch}
    t0 = time.perf_counter()
    counters.clear()
    gc.collect()  # anything of the previous variant held only by reference cycles, before this one is measured
    row["leftover_mem_gib"] = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    model, batch, opts, logs = build_variant(model_name, precision, batch=args.batch, device=device,
                                             compile_dense=not args.no_compile, vocab=args.vocab,
                                             compile_mode=args.compile_mode,
                                             plan_dir=plans_dir(args) / variant_name(model_name, precision))
    row["train_step_ms"] = timed_ms(lambda: train_step(model, batch, opts), args.steps, args.warmup)
    # after warm-up: the optimizer states exist and the compiled graphs are built, as in a long run
    mem = cuda_peak_memory(lambda: train_step(model, batch, opts), device)
    row.update(train_peak_mem_gib=mem.peak / GIB, train_peak_reserved_gib=mem.peak_reserved / GIB,
               resident_mem_gib=mem.before / GIB, **forward_memory(model, batch, device))
    row.update({f"train_{k}": v for k, v in kernel_split_ms(lambda: train_step(model, batch, opts)).items()})
    row.update({f"infer_{k}": v for k, v in kernel_split_ms(lambda: infer_step(model, batch)).items()})
    model.eval()
    row["infer_step_ms"] = timed_ms(lambda: infer_step(model, batch), args.steps, args.warmup)
    row["train_examples_per_s"] = args.batch / row["train_step_ms"] * 1e3
    row["infer_examples_per_s"] = args.batch / row["infer_step_ms"] * 1e3
    row["setup_and_measure_s"] = time.perf_counter() - t0
    row["dynamo"] = dynamo_summary()
    row["log"] = [line.splitlines()[-1] for line in logs]  # summaries; the full plan table is in "log_full"
    row["log_full"] = logs
    return row


def variant_name(model_name: str, precision: str) -> str:
    """A variant's folder name: ``wukong_h200_loka``, ``wukong_h200_fp8_tensorwise_auto_filter``."""
    return f"{model_name}_{precision.replace('+', '_')}"


def plans_dir(args) -> Path:
    """Where Dispatch plans go: OUT/plans, also for a variant's own process (``--plans-dir``)."""
    return args.plans_dir or args.out / "plans"


def child_command(model_name: str, precision: str, args) -> tuple[list[str], Path]:
    """(the command that measures one variant in a process of its own, the folder of its bench_e2e.json)."""
    out = args.out / "variants" / variant_name(model_name, precision)
    cmd = [sys.executable, "-m", "scripts.bench_e2e_gpu", str(out), "--models", model_name, "--precisions",
           precision, "--in-process", "--batch", str(args.batch), "--vocab", str(args.vocab), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--plans-dir", str(plans_dir(args))]
    cmd += ["--no-compile"] if args.no_compile else []
    cmd += ["--compile-mode", args.compile_mode] if args.compile_mode else []
    return cmd, out


def measure_in_process_of_its_own(model_name: str, precision: str, args, run=subprocess.run) -> dict:
    """One variant's row, measured by ``child_command`` (its output shown as it runs); a process that fails or
    writes no row -> a row with its status."""
    cmd, out = child_command(model_name, precision, args)
    result = out / "bench_e2e.json"
    result.unlink(missing_ok=True)  # a row from an earlier run must not stand in for this one
    proc = run(cmd, cwd=ROOT)
    rows = json.loads(result.read_text())["rows"] if result.is_file() else []
    if proc.returncode != 0 or len(rows) != 1:
        return {"model": model_name, "precision": precision,
                "status": f"error: its process exited with {proc.returncode}, {len(rows)} rows written"}
    return rows[0]


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["precision"] == "bf16"
                     and "train_step_ms" in b), None)
        if base and "train_step_ms" in r:
            r["train_speedup_vs_bf16"] = base["train_step_ms"] / r["train_step_ms"]
            r["infer_speedup_vs_bf16"] = base["infer_step_ms"] / r["infer_step_ms"]


def table(rows: list[dict]) -> str:
    """Wall times and ratios per variant, the training step's GPU kernel time per category, what one forward keeps
    and the step's peak GPU memory (allocated, GiB; n/a in rows recorded before they were measured)."""
    lines = [f"{'model':<12} {'precision':<18} {'train ms':>9} {'x bf16':>7} {'infer ms':>9} {'x bf16':>7} "
             f"{'GPU ms':>7} {'GEMM ms':>8} {'quant ms':>8} {'epi ms':>7} {'attn ms':>8} {'rest ms':>8} "
             f"{'breaks':>6} {'kept GiB':>8} {'peak GiB':>8}"]
    for r in rows:
        if "train_step_ms" not in r:
            lines.append(f"{r['model']:<12} {r['precision']:<18} {r.get('status', 'error')}")
            continue
        gpu = sum(r.get(f"train_{cat}_ms", 0.0) for cat in CATEGORIES)
        peak = f"{r['train_peak_mem_gib']:8.2f}" if "train_peak_mem_gib" in r else f"{'n/a':>8}"
        kept = f"{r['forward_kept_gib']:8.2f}" if r.get("forward_kept_gib") is not None else f"{'n/a':>8}"
        nan = float("nan")
        lines.append(f"{r['model']:<12} {r['precision']:<18} {r['train_step_ms']:9.3f} "
                     f"{r.get('train_speedup_vs_bf16', nan):7.2f} {r['infer_step_ms']:9.3f} "
                     f"{r.get('infer_speedup_vs_bf16', nan):7.2f} {gpu:7.2f} {r['train_gemm_ms']:8.3f} "
                     f"{r.get('train_quantization_ms', nan):8.3f} {r.get('train_epilogue_ms', nan):7.3f} "
                     f"{r.get('train_attention_ms', nan):8.3f} {r['train_other_ms']:8.3f} "
                     f"{r.get('dynamo', {}).get('graph_breaks', -1):6d} {kept} {peak}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "train_step_ms" in r]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(ok)), 4))
    labels = [f"{r['model']}\n{r['precision']}" for r in ok]
    bottom = [0.0] * len(ok)
    for key, label in (("train_gemm_ms", "GEMM kernels"), ("train_quantization_ms", "FP8 quantization kernels"),
                       ("train_epilogue_ms", "Mods epilogue kernels"), ("train_attention_ms", "attention kernels"),
                       ("train_other_ms", "other kernels")):
        if not any(key in r for r in ok):  # JSON written before that category was split out
            continue
        heights = [r.get(key, 0.0) for r in ok]
        ax.bar(labels, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.scatter(labels, [r["train_step_ms"] for r in ok], color="black", zorder=3, label="step wall time")
    ax.set_ylabel("ms per training step")
    ax.set_title(f"training step, batch {ok[0]['batch']}: GPU time by kernel kind, wall time")
    ax.legend(fontsize=8)
    plt.xticks(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=writable_dir)
    ap.add_argument("--models", nargs="+", default=["wukong", "interformer"],
                    help="zoo names (schema defaults, paper-like) or conf/model file names, e.g. wukong_h200")
    ap.add_argument("--precisions", nargs="+",
                    default=["bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp", "bf16+mods", "loka"])
    ap.add_argument("--batch", type=positive_int, default=4096)
    ap.add_argument("--vocab", type=positive_int, default=DataConfig.max_vocab_size, help="rows per embedding table")
    ap.add_argument("--steps", type=positive_int, default=20)
    ap.add_argument("--warmup", type=non_negative_int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-mode", default=None, choices=[None, "reduce-overhead", "max-autotune-no-cudagraphs"],
                    help="torch.compile mode of the dense units (reduce-overhead: CUDA graphs, no launch cost)")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--in-process", action="store_true",
                    help="all variants in this process, one after another (default: each in a process of its own)")
    ap.add_argument("--plans-dir", type=Path, default=None, help=argparse.SUPPRESS)  # a variant's process: OUT/plans
    args = ap.parse_args()
    for name in args.models:  # bad names fail here, before any device work
        model_config(name)
    for name in args.precisions:
        precision_config(name)
    require_cuda(ap)
    device = torch.device("cuda", 0)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**provenance(), "compiled_dense": not args.no_compile,
            "compile_mode": args.compile_mode or "default",
            "rows_per_table": args.vocab, "in_process": args.in_process}
    rows, start = [], time.perf_counter()
    jobs = [(m, p) for p in args.precisions for m in args.models]  # every model gets the first precisions first
    for model_name, precision in tqdm(jobs, desc="e2e variants", unit="variant"):
        if time.perf_counter() - start > args.budget_s:
            rows.append({"model": model_name, "precision": precision, "status": "skipped (time budget)"})
            continue
        if not args.in_process:
            rows.append(measure_in_process_of_its_own(model_name, precision, args))
        else:
            try:
                rows.append(measure(model_name, precision, args, device))
            except Exception as exc:  # one variant failing must not lose the others
                rows.append({"model": model_name, "precision": precision, "status": f"error: {exc!r}"[:300],
                             "traceback": traceback.format_exc()[-2000:]})
            torch.cuda.empty_cache()
        add_ratios(rows)
        (args.out / "bench_e2e.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / "bench_e2e.png")
    print(table(rows))


if __name__ == "__main__":
    main()
