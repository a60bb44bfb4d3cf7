"""cuBLASLt's FP8 GEMMs of the fused Mods layer with and without fast accumulation
(``torch._scaled_mm(use_fast_accum=)``), by graph replay, at the nine Mods layer shapes, batch 1024, next to cuBLAS
BF16: the forward z = x·Wᵀ (tensorwise unit-scale e4m3, as the split FP8 forward runs it; rowwise e4m3), the input
grad dx = dz·W (tensorwise e5m2 x e4m3; rowwise e4m3) and the weight grad dW = dzᵀ·x (tensorwise e5m2 x e4m3 on
transposed operands, as the folded weight grad runs it). Also each fast-accumulation GEMM's error against the
other's output (relative Frobenius), on random normal operands.

    python -m benchmarks.fast_accum_gemms OUT.json
"""
import argparse
import datetime
import json
from pathlib import Path
from typing import Optional

import torch

from loka_trainer.arg_types import require_cuda, writable_file
from loka_trainer.timing import cuda_graph_us
from scripts.mods_layer_variants import BATCH, MODS_LAYER_SHAPES

SHAPES = MODS_LAYER_SHAPES
M = BATCH
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8(rows, cols, dtype):
    return (torch.randn(rows, cols, device="cuda") * 4).to(dtype)


def gemms(K, N):
    """{gemm: (a (R, C) fp8, b (P, C) fp8, scale_a, scale_b, bf16 a, bf16 b)}: y = a·bᵀ."""
    one = torch.ones((), device="cuda")
    out = {}
    for name, (R, C, P, da, db) in {"fwd": (M, K, N, E4, E4), "dgrad": (M, N, K, E5, E4),
                                    "wgrad": (N, M, K, E5, E4)}.items():
        a, b = fp8(R, C, da), fp8(P, C, db)
        out[f"{name}_tensorwise"] = (a, b, one, one)
        if name != "wgrad":
            ar, br = fp8(R, C, E4), fp8(P, C, E4)
            sa, sb = torch.rand(R, 1, device="cuda") + 0.5, torch.rand(1, P, device="cuda") + 0.5
            out[f"{name}_rowwise"] = (ar, br, sa, sb)
        out[f"{name}_bf16"] = (a.to(torch.bfloat16), b.to(torch.bfloat16), None, None)
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; a path that cannot be written is argparse's error, a machine without CUDA one
    ``error:`` line (exit status 2 for both), before anything runs."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fast_accum_gemms", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_json", type=writable_file, help="the JSON file of per-shape timings and errors")
    args = ap.parse_args(argv)
    require_cuda(ap)
    return args


def run(out_json: Path) -> None:
    """Time every GEMM at every shape, write ``out_json`` and print the table."""
    rows = []
    for K, N in SHAPES:
        res = {"K": K, "N": N}
        for name, (a, b, sa, sb) in gemms(K, N).items():
            if sa is None:
                res[name] = cuda_graph_us(lambda: a @ b.t())
                continue
            mm = lambda fast: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,  # noqa: E731
                                               use_fast_accum=fast)
            res[name] = cuda_graph_us(lambda: mm(False))
            res[name + "_fast"] = cuda_graph_us(lambda: mm(True))
            exact, fast = mm(False).float(), mm(True).float()
            res[name + "_fast_rel_err"] = float((fast - exact).norm() / exact.norm())
        rows.append(res)
        print(K, N, {k: round(v, 2) if "err" not in k else f"{v:.1e}" for k, v in res.items() if k not in ("K", "N")},
              flush=True)

    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": "python -m benchmarks.fast_accum_gemms OUT.json", "M": M}
    Path(out_json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n(in, out)    " + "  ".join(f"{g:>16s}" for g in ["fwd tw slow/fast", "fwd rw slow/fast", "dgrad tw",
                                                                "dgrad rw", "wgrad tw", "bf16 f/d/w"]))
    for r in rows:
        cells = [f"{r[g]:6.1f}/{r[g + '_fast']:6.1f}" for g in ["fwd_tensorwise", "fwd_rowwise", "dgrad_tensorwise",
                                                                "dgrad_rowwise", "wgrad_tensorwise"]]
        cells.append(f"{r['fwd_bf16']:.1f}/{r['dgrad_bf16']:.1f}/{r['wgrad_bf16']:.1f}")
        print(f"({r['K']}, {r['N']})".ljust(13) + "  ".join(f"{c:>16s}" for c in cells))


def main(argv: Optional[list[str]] = None) -> None:
    run(parse_args(argv).out_json)


if __name__ == "__main__":
    main()
