"""Multi-GPU training throughput with FSDP2 on the dense part, LoKA on vs off, measured side by side.

    torchrun --nproc_per_node=2 -m scripts.bench_fsdp2_gpu OUT_DIR [--model wukong] [--batch 4096]
        [--precisions bf16 fp8_rowwise_gw_hp bf16+mods loka] [--vocab 10000] [--steps 20] [--no-compile]
        [--device cpu]   (gloo on CPU: a functional check of this script, its times mean nothing)

Each variant is built as in ``scripts.bench_e2e_gpu`` (zoo model at its paper-size defaults, precision applied as
``train.py`` does; a ``loka`` plan is measured on rank 0 and broadcast), then every dense unit
(``model.dense_units()``) gets FSDP2 ``fully_shard`` with a BF16 gradient reduce (``MixedPrecisionPolicy``,
as ``sharding.fsdp_reduce_dtype=bfloat16`` does in training) and is compiled.

Embeddings: TorchRec's sharded embedding kernels need the CUDA fbgemm build, so here the tables are
**unsharded and replicated** on every rank (like TorchRec's ``data_parallel`` sharding type): their dense
gradients are all-reduced (mean, fp32) after backward and each rank applies SGD. ``--vocab`` rows per table
keeps that all-reduce small; it is the same for every precision.

A step = forward under BF16 autocast, BCE, backward (FSDP2 reduce-scatters dense grads in BF16), embedding
all-reduce, fused Adam (dense) + SGD (embeddings). Time = CUDA-event wall time per step on rank 0 after a
barrier-synchronised warm-up, over ``--steps`` steps. Writes OUT_DIR/bench_fsdp2.json and bench_fsdp2.png
(examples/s per precision) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from loka_trainer.arg_types import non_negative_int, positive_int, writable_dir
from scripts.bench_e2e_gpu import build_variant, timed_ms
from scripts.provenance import provenance


def shard_dense_units(model: torch.nn.Module) -> None:
    """FSDP2 on each dense unit, parameters in their dtype, gradients reduced in BF16."""
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for unit in model.dense_units():
        fully_shard(unit, mesh=mesh, mp_policy=policy)


def train_step(model, batch, opts, embedding_params) -> None:
    with torch.autocast(batch.labels.device.type, dtype=torch.bfloat16):
        logits = model(batch).float()
    F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    for p in embedding_params:  # replicated tables: data-parallel mean of their gradients
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


def measure(precision: str, args, device) -> dict:
    model, batch, opts, logs = build_variant(args.model, precision, batch=args.batch, device=device,
                                             compile_dense=not args.no_compile, vocab=args.vocab,
                                             shard_dense=shard_dense_units)
    embedding_params = list(opts[1].param_groups[0]["params"])
    step = lambda: train_step(model, batch, opts, embedding_params)
    for _ in range(args.warmup):
        step()
    dist.barrier()
    ms = timed_ms(step, args.steps, warmup=0, device_type=device.type)
    world = dist.get_world_size()
    return {"precision": precision, "step_ms": ms, "examples_per_s": world * args.batch / ms * 1e3,
            "log": [line.splitlines()[-1] for line in logs]}


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["precision"] == "bf16" and "step_ms" in r), None)
    lines = [f"{'precision':<20} {'step ms':>9} {'examples/s':>12} {'x bf16':>7}"]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"{r['precision']:<20} {r.get('status', 'error')[:80]}")
            continue
        ratio = base["step_ms"] / r["step_ms"] if base else float("nan")
        r["speedup_vs_bf16"] = ratio
        lines.append(f"{r['precision']:<20} {r['step_ms']:9.3f} {r['examples_per_s']:12.0f} {ratio:7.2f}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Bars of examples/s per precision (all GPUs), each labelled with its ratio to BF16."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if "step_ms" in r]
    if not ok:
        return
    base = next((r["step_ms"] for r in ok if r["precision"] == "bf16"), None)
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(ok)), 3.6))
    bars = ax.bar([r["precision"] for r in ok], [r["examples_per_s"] for r in ok])
    if base:
        ax.bar_label(bars, labels=[f"{base / r['step_ms']:.2f}× BF16" for r in ok], fontsize=8)
    meta = result["meta"]
    ax.set_ylabel("training examples/s, all GPUs")
    ax.set_title(f"{meta['model']}, FSDP2 on {meta['gpus']}× {meta['device']}, batch {meta['per_gpu_batch']} per GPU",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=writable_dir)
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8_rowwise_gw_hp", "bf16+mods", "loka"])
    ap.add_argument("--batch", type=positive_int, default=4096, help="per-GPU batch")
    ap.add_argument("--vocab", type=positive_int, default=10_000, help="rows per (replicated) embedding table")
    ap.add_argument("--steps", type=positive_int, default=20)
    ap.add_argument("--warmup", type=non_negative_int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    if "LOCAL_RANK" not in os.environ or (args.device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit("bench_fsdp2_gpu.py needs torchrun (--nproc_per_node=N) and CUDA devices (or --device cpu)")
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rows = []
    for precision in args.precisions:
        try:
            rows.append(measure(precision, args, device))
        except Exception as exc:  # one variant failing must not lose the others
            rows.append({"precision": precision, "status": f"error: {exc!r}"[:300],
                         "traceback": traceback.format_exc()[-2000:]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    if dist.get_rank() == 0:
        text = table(rows)
        meta = {**provenance(), "gpus": dist.get_world_size(),
                "model": args.model, "per_gpu_batch": args.batch, "rows_per_table": args.vocab,
                "embeddings": "unsharded, replicated, gradients all-reduced (fp32 mean)",
                "dense": "FSDP2 fully_shard per dense unit, BF16 reduce" + ("" if args.no_compile else ", compiled")}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_fsdp2.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot({"meta": meta, "rows": rows}, args.out / "bench_fsdp2.png")
        print(text)
    dist.barrier()  # tear down together: a rank leaving early can abort the other's gloo transport
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # NOTE: on 2 gloo ranks under load, interpreter teardown after FSDP2 occasionally aborted a finished rank
    # ("terminate called without an active exception"); everything is written by now, so skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
