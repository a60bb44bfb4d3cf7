"""The memory-bound Triton kernels of the fused Mods layer alone, by graph replay, over their launch shapes (rows per
program x warps) at the nine Mods layer shapes, batch 1024: x's rowwise quantizer, the split modes' epilogue kernel
(norm_fwd_kernel as split_fp8 and split_bf16 launch it), the dz kernel (as split_fp8_dgrad and split_bf16 launch it)
and the rowwise cast of dz (quant_rows_kernel). The launch shapes the layer ships with came from this sweep
(docs/kernels/README.md, "Backward", Launch).

    python -m benchmarks.sweep_memory_kernels OUT.json
"""
import argparse
import itertools
import json
from typing import Optional

import torch

from loka_trainer.arg_types import require_cuda, writable_file
from loka_trainer.kernels import pdl
from loka_trainer.kernels.quant import EPS
from loka_trainer.kernels.triton_quant_kernels import quant_rowwise_kernel
from loka_trainer.mods import triton_mods
from loka_trainer.mods.triton_mods_kernels import bwd_dz_kernel, norm_fwd_kernel, quant_rows_kernel
from loka_trainer.timing import cuda_graph_us
from scripts.mods_layer_variants import BATCH, MODS_LAYER_SHAPES

SHAPES = MODS_LAYER_SHAPES
M, B, E4M3 = BATCH, 256, float(torch.finfo(torch.float8_e4m3fn).max)
cdiv = lambda a, b: -(-a // b)  # noqa: E731


def sweep(name, launch, grid_rows, warps, default):
    """{config: µs} of launch(rows, warps) for each combination; default = the shipped (rows, warps)."""
    out = {}
    for rows, w in itertools.product(grid_rows, warps):
        try:
            out[f"{rows}x{w}"] = cuda_graph_us(lambda: launch(rows, w), rep_ms=20)
        except Exception as e:  # a config that does not compile or run here is not a candidate
            out[f"{rows}x{w}"] = f"{type(e).__name__}: {str(e)[:80]}"
    ok = {k: v for k, v in out.items() if isinstance(v, float)}
    best = min(ok, key=ok.get)
    d = f"{default[0]}x{default[1]}"
    return {"kernel": name, "default": d, "default_us": ok.get(d), "best": best, "best_us": ok[best], "all": out}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; a path that cannot be written is argparse's error, a machine without CUDA one
    ``error:`` line (exit status 2 for both), before anything runs."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sweep_memory_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_json", type=writable_file, help="the JSON file of the sweep (OUT.json.partial meanwhile)")
    args = ap.parse_args(argv)
    require_cuda(ap)
    return args


def run(out_json: str) -> None:
    """Sweep every kernel's launch shapes at every layer shape, write ``out_json`` and print the summary."""
    rows_out = []
    for K, N in SHAPES:
        dev = "cuda"
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        z = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        sx, sw = torch.rand(M, device=dev) + 0.5, torch.rand(N, device=dev) + 0.5
        NB = N // B
        y, u = torch.empty_like(z), torch.empty_like(z)
        r = torch.rand(M, NB, device=dev) + 0.5
        q8 = torch.empty(M, N, device=dev, dtype=torch.float8_e4m3fn)
        la = pdl.launch_args(x)
        res = {"K": K, "N": N, "kernels": []}

        whole = 1 << (K - 1).bit_length()
        xq = torch.empty(M, K, device=dev, dtype=torch.float8_e4m3fn)
        xs = torch.empty(M, 1, device=dev)

        def quant_x(rows, w):
            quant_rowwise_kernel[(cdiv(M, rows),)](x, xq, xs, M, K, x.stride(0), 1, xq.stride(0), FP8_MAX=E4M3,
                                                   EPS_=EPS, ROWS=rows, COLS=whole, SINGLE_PASS=True, num_warps=w, **la)
        d_rows = max(1, 4096 // whole)
        res["kernels"].append(sweep("quant_rowwise(x)", quant_x, sorted({max(1, d_rows // 2), d_rows, 2 * d_rows}),
                                    [4, 8, 16], (d_rows, 8 if d_rows * whole >= 4096 else 4)))

        def norm_fp8(rows, w):  # split_fp8: unit-scale GEMM's z, scales applied, z kept (SAVE_Z)
            norm_fwd_kernel[(cdiv(M, rows), NB)](z, sx, sw, y, y, r, y, M, z.stride(0), M * N, y.stride(0), r.stride(0),
                                                 1e-6, 1.0, FP8_MAX_=E4M3, WRITE_FP8=False, SAVE_FOR_BACKWARD=True,
                                                 SAVE_Z=True, SPLITS=1, HAS_SCALES=True, BLOCK_N=B, BLOCK_M=rows,
                                                 num_warps=w, **la)
        res["kernels"].append(sweep("norm_fwd(split_fp8)", norm_fp8, [8, 16, 32], [2, 4, 8], (16, 4)))

        splits = triton_mods.cublas_split_k_for(x, N, B)
        if splits > 1:
            zs = torch.randn(splits, M, N, device=dev)

            def norm_splitk(rows, w):  # split_bf16 with cuBLAS split-K: sums the fp32 slices, writes the summed z
                norm_fwd_kernel[(cdiv(M, rows), NB)](zs, sx, sw, y, u, r, y, M, N, M * N, y.stride(0), r.stride(0),
                                                     1e-6, 1.0, FP8_MAX_=E4M3, WRITE_FP8=False, SAVE_FOR_BACKWARD=True,
                                                     SAVE_Z=True, SPLITS=splits, HAS_SCALES=False, BLOCK_N=B,
                                                     BLOCK_M=rows, num_warps=w, **la)
            res["kernels"].append(sweep(f"norm_fwd(split_bf16, {splits} slices)", norm_splitk, [8, 16, 32],
                                        [2, 4, 8], (16, 4)))

        dz = torch.empty_like(z)
        amax = torch.empty(M, NB, device=dev)

        def dz_fp8(rows, w):  # split_fp8_dgrad: u from z and the GEMM's scales, (row, block) amaxes for the cast
            bwd_dz_kernel[(cdiv(M, rows), NB)](dy, z, r, sx, sw, dz, amax, dz, dz, M, dy.stride(0), z.stride(0),
                                               r.stride(0), dz.stride(0), amax.stride(0), FROM_Z=True, Z_SCALES=True,
                                               AMAX=1, FOLD=False, TILE_MAXIMA=False, BLOCK_N=B, BLOCK_M=rows,
                                               num_warps=w, **la)
        res["kernels"].append(sweep("bwd_dz(split_fp8_dgrad)", dz_fp8, [8, 16, 32], [2, 4, 8], (16, 4)))

        def dz_bf16(rows, w):  # split_bf16: u from z, no amax
            bwd_dz_kernel[(cdiv(M, rows), NB)](dy, z, r, r, r, dz, dz, dz, dz, M, dy.stride(0), z.stride(0),
                                               r.stride(0), dz.stride(0), 0, FROM_Z=True, Z_SCALES=False, AMAX=0,
                                               FOLD=False, TILE_MAXIMA=False, BLOCK_N=B, BLOCK_M=rows, num_warps=w,
                                               **la)
        res["kernels"].append(sweep("bwd_dz(split_bf16)", dz_bf16, [8, 16, 32], [2, 4, 8], (16, 4)))

        s = torch.empty(M, 1, device=dev)

        def cast_rows(rows, w):  # the rowwise e4m3 cast of dz (row amax from the (M, NB) amaxes)
            quant_rows_kernel[(cdiv(M, rows), NB)](dz, amax, q8, s, dz, dz, q8, s, M, NB, dz.stride(0), amax.stride(0),
                                                   q8.stride(0), 0, FP8_MAX_=E4M3, EPS_=EPS,
                                                   NB_P2=1 << (NB - 1).bit_length(), FOLD=False, FOLD_FP8_MAX=1.0,
                                                   BLOCK_N=B, BLOCK_M=rows, num_warps=w, **la)
        res["kernels"].append(sweep("quant_rows(dz)", cast_rows, [16, 32, 64], [2, 4, 8], (16, 4)))
        rows_out.append(res)
        json.dump({"rows": rows_out}, open(out_json + ".partial", "w"))
        print(json.dumps({"K": K, "N": N, **{k["kernel"]: (k["default"], round(k["default_us"] or -1, 2), k["best"],
                                                            round(k["best_us"], 2)) for k in res["kernels"]}}),
              flush=True)

    meta = {"date": __import__("datetime").date.today().isoformat(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "command": "python -m benchmarks.sweep_memory_kernels OUT.json",
            "batch": M, "note": "graph-replay µs of each kernel alone; config = rows per program x warps"}
    json.dump({"meta": meta, "rows": rows_out}, open(out_json, "w"), indent=1)
    print("\n(K,N) kernel: default -> best (µs)")
    for res in rows_out:
        for k in res["kernels"]:
            print(f"({res['K']},{res['N']}) {k['kernel']}: {k['default']} {k['default_us']:.2f} -> {k['best']} "
                  f"{k['best_us']:.2f}")


def main(argv: Optional[list[str]] = None) -> None:
    run(str(parse_args(argv).out_json))


if __name__ == "__main__":
    main()
