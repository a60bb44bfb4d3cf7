"""Where one Mods layer's GPU time goes: per-kernel GPU µs of one forward+backward, per variant and shape.

    python -m benchmarks.profile_mods_layers_gpu OUT_DIR [--shapes 4096x2048 7680x256]
        [--variants base_eager split_bf16]

Variants are ``scripts.mods_layer_variants``'s (suite (b) of ``scripts.bench_dispatch_gpu``; batch 1024). Each
is warmed up, then ``--steps`` steps run under ``torch.profiler`` (CUDA activity); kernel times are summed per
kernel name and divided by the steps. Kernels are classed by ``scripts.bench_e2e_gpu.kernel_category`` (GEMM =
cuBLAS / CUTLASS / nvjet / our fused GEMM kernels), so the table shows how much of the layer is GEMM time that no
epilogue fusion removes. Writes OUT_DIR/profile_mods_layers.json; prints a table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from scripts.kernel_split import is_gpu_annotation, kernel_category
from loka_trainer.timing import with_grads_reset
from scripts.mods_layer_variants import BATCH, build_mods_layer_variants


def is_gemm(kernel_name: str) -> bool:
    return kernel_category(kernel_name) == "gemm"


def kernel_times(fn, grad_to_none: list[torch.Tensor], steps: int) -> dict[str, float]:
    """kernel name -> GPU µs per call of ``fn`` (summed over ``steps`` profiled calls, then divided); the
    ``.grad`` of ``grad_to_none`` is reset before each call, as in a training step."""
    from torch.profiler import ProfilerActivity, profile

    call = with_grads_reset(fn, grad_to_none)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    out = {e.key: e.device_time_total / steps for e in prof.key_averages()
           if e.device_type.name == "CUDA" and e.device_time_total > 0 and not is_gpu_annotation(e.key)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shapes", nargs="+", default=["4096x2048", "2048x4096", "7680x512", "7680x256"],
                   help="(in)x(out) layer shapes")
    p.add_argument("--variants", nargs="+", default=["base_eager", "mods_compiled", "split_bf16", "split_fp8_dgrad"])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_mods_layers_gpu: needs a CUDA device")
    rows = []
    for shape in args.shapes:
        K, N = (int(v) for v in shape.split("x"))
        torch._dynamo.reset()
        x = torch.randn(BATCH, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(BATCH, N, device="cuda", dtype=torch.bfloat16)
        variants, params = build_mods_layer_variants(K, N, set(args.variants))
        for name, f in variants.items():
            try:
                kernels = kernel_times(lambda f=f: f(x).backward(dy), [x, *params], args.steps)
            except Exception as e:  # noqa: BLE001 -- a failing variant is reported, the rest still run
                rows.append({"K": K, "N": N, "variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            gemm = sum(t for k, t in kernels.items() if is_gemm(k))
            rows.append({"K": K, "N": N, "variant": name, "total_us": sum(kernels.values()), "gemm_us": gemm,
                         "kernels_us": kernels})
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": " ".join(sys.argv), "batch": BATCH}
    (args.out_dir / "profile_mods_layers.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{'(in,out)':>12} {'variant':<18} {'total µs':>9} {'GEMM µs':>8} {'other µs':>9}  top non-GEMM kernels")
    for r in rows:
        if "error" in r:
            print(f"({r['K']},{r['N']}) {r['variant']:<18} {r['error'][:80]}")
            continue
        other = [(k[:40], t) for k, t in r["kernels_us"].items() if not is_gemm(k)][:3]
        print(f"{'(%d,%d)' % (r['K'], r['N']):>12} {r['variant']:<18} {r['total_us']:9.1f} {r['gemm_us']:8.1f} "
              f"{r['total_us'] - r['gemm_us']:9.1f}  " + "; ".join(f"{k} {t:.1f}" for k, t in other))


if __name__ == "__main__":
    main()
