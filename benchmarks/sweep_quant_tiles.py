"""The rowwise FP8 quantizer (``quant_rowwise_kernel``) over its tile, on the operands of wukong_h200's FP8 GEMMs at
batch 8192: row-major ``a`` and the transposed view ``a.t()`` the weight-grad GEMM quantizes, beside the tile it
ships with (``triton_quant._tile``) and inductor's kernels for the same math (``quant.quantize_rowwise`` compiled,
its q made row-major as the GEMM needs it).

    python -m benchmarks.sweep_quant_tiles OUT [--shapes 8192x4096 ...] [--layouts row-major transposed]

A tile is (rows x cols per program, one pass or two, warps). One pass holds whole rows on chip and reads ``t`` once;
two passes read it again for the cast, from L2 only while the programs running at once fit there. A transposed
one-pass tile of a few rows reads part of each 32-byte sector and leaves the rest in L2 for the programs beside it.
Every candidate's q and scales must equal the shipped tile's bit for bit (a mismatch is reported and not ranked).
GPU µs by CUDA-graph replay; TB/s = (bf16 read + fp8 written + fp32 scales) / time.

Then what it would change for Dispatch: wukong_h200's weight-grad GEMMs, dW = dyᵀ·x, in BF16 against rowwise
``_scaled_mm`` with fast accumulation plus the two transposed quantizations it needs, with the shipped tile and with
the best one (Dispatch runs a GEMM in FP8 when it is more than 1.05× faster with its quantization). Writes
OUT/sweep_quant_tiles.json and .png and prints both tables last.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from loka_trainer.arg_types import writable_dir

# (R, C) of ``a`` (bf16): x and dy of the FP8 GEMMs at batch 8192 (K or N = 2048 ... 32768) and the weights quantized
# every step (4096x4096, 16384x4096 of fmb.out, 2048x32768 of over_arch.mlp.0)
DEFAULT_SHAPES = ["8192x2048", "8192x4096", "8192x16384", "8192x32768", "4096x4096", "16384x4096", "2048x32768"]
LAYOUTS = ("row-major", "transposed")
# (M, K, N) of wukong_h200's weight-grad GEMMs at batch 8192: fmb.mlp, fmb.out, over_arch.mlp.0
WGRAD_GEMMS = [(8192, 4096, 4096), (8192, 4096, 16384), (8192, 32768, 2048)]
# on-chip budget of a one-pass tile: elements per program (fp32 in registers) and per thread
ONE_PASS_MAX_ELEMENTS, MAX_PER_THREAD = 32768, 128


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_name(tile: tuple[int, int, bool, int]) -> str:
    rows, cols, one_pass, warps = tile
    return f"{rows}x{cols} {'1p' if one_pass else '2p'} w{warps}"


def candidate_tiles(R: int, C: int, row_major: bool) -> list[tuple[int, int, bool, int]]:
    """(rows, cols, one_pass, warps) tiles to try for t (R, C); the first is the shipped one.

    One pass: whole rows (cols = C rounded up to a power of two), rows x cols <= ONE_PASS_MAX_ELEMENTS and at most
    MAX_PER_THREAD elements per thread. Two passes: row-major, 512-2048-wide chunks of 1-16 rows; transposed, 16-128
    rows (32-256 bytes along the contiguous dim) by 32-256 columns."""
    from loka_trainer.kernels.triton_quant import _tile
    tiles = [_tile(R, C, row_major)]
    whole, r_max = _pow2(C), _pow2(R)
    for rows in (1, 2, 4, 8, 16, 32):
        if rows <= r_max and rows * whole <= ONE_PASS_MAX_ELEMENTS:
            tiles += [(rows, whole, True, w) for w in (4, 8, 16) if rows * whole <= MAX_PER_THREAD * 32 * w]
    if row_major:
        two = [(rows, cols) for rows in (1, 2, 4, 8, 16) for cols in (512, 1024, 2048) if cols < whole]
    else:
        two = [(rows, cols) for rows in (16, 32, 64, 128) for cols in (32, 64, 128, 256) if cols <= whole]
    tiles += [(rows, cols, False, w) for rows, cols in two if rows <= r_max for w in (4, 8)]
    return list(dict.fromkeys(tiles))


def moved_bytes(R: int, C: int) -> int:
    """bf16 read once + fp8 written + fp32 scale per row: the least any quantizer moves."""
    return R * C * 3 + R * 4


def launch_tile(t: torch.Tensor, q: torch.Tensor, s: torch.Tensor, tile: tuple[int, int, bool, int]) -> None:
    """quant_rowwise_kernel on t (R, C) into q (R, C) fp8 and s (R, 1) fp32 with the given tile."""
    from loka_trainer.kernels import pdl
    from loka_trainer.kernels.quant import EPS
    from loka_trainer.kernels.triton_quant_kernels import quant_rowwise_kernel
    rows, cols, one_pass, warps = tile
    R, C = t.shape
    quant_rowwise_kernel[(-(-R // rows),)](
        t, q, s, R, C, t.stride(0), t.stride(1), q.stride(0), FP8_MAX=torch.finfo(q.dtype).max, EPS_=EPS, ROWS=rows,
        COLS=cols, SINGLE_PASS=one_pass, num_warps=warps, **pdl.launch_args(t))


def inductor_quantizer():
    """quant.quantize_rowwise compiled by inductor, q made row-major (R, C) as the FP8 GEMM reads it; a fresh
    dynamo cache, so one compile per shape and layout stays under dynamo's recompile limit."""
    from loka_trainer.kernels.quant import quantize_rowwise
    torch._dynamo.reset()

    def quant(t):
        q, s = quantize_rowwise(t, torch.float8_e4m3fn)
        return q.contiguous(), s
    return torch.compile(quant, dynamic=False)


def sweep_shape(R: int, C: int, layout: str) -> dict:
    """{tile name: µs or error} for t (R, C) in ``layout``, the shipped tile, the best tile and inductor."""
    from loka_trainer.timing import cuda_graph_us
    row_major = layout == "row-major"
    a = torch.randn((R, C) if row_major else (C, R), device="cuda", dtype=torch.bfloat16)
    t = a if row_major else a.t()
    q = torch.empty(R, C, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(R, 1, device="cuda")
    tiles = candidate_tiles(R, C, row_major)
    launch_tile(t, q, s, tiles[0])
    q_ref, s_ref = q.view(torch.uint8).clone(), s.clone()
    times: dict[str, object] = {}
    for tile in tiles:
        try:
            q.zero_()
            launch_tile(t, q, s, tile)
            if not (torch.equal(q.view(torch.uint8), q_ref) and torch.equal(s, s_ref)):
                times[tile_name(tile)] = "mismatch"
                continue
            times[tile_name(tile)] = cuda_graph_us(lambda: launch_tile(t, q, s, tile), rep_ms=10, replays=5)
        except Exception as e:  # a tile that does not compile or launch here is not a candidate
            times[tile_name(tile)] = f"{type(e).__name__}: {str(e)[:80]}"
    compiled = inductor_quantizer()
    qc, sc = compiled(t)
    ind_ok = torch.equal(qc.view(torch.uint8), q_ref) and torch.equal(sc, s_ref)
    ind_us = cuda_graph_us(lambda: compiled(t), rep_ms=10, replays=5)
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    best = min(ok, key=ok.get)
    shipped = tile_name(tiles[0])
    tbps = lambda us: moved_bytes(R, C) / us / 1e6  # noqa: E731
    return {"R": R, "C": C, "layout": layout, "shipped": shipped, "shipped_us": ok[shipped],
            "shipped_tbps": tbps(ok[shipped]), "best": best, "best_us": ok[best], "best_tbps": tbps(ok[best]),
            "inductor_us": ind_us, "inductor_tbps": tbps(ind_us), "inductor_equal": ind_ok, "tiles": times}


def weight_grad_outlook(M: int, K: int, N: int, rows: list[dict], bf16_us: float, fp8_gemm_us: float
                        ) -> Optional[dict]:
    """BF16 / (FP8 GEMM + quantizing dyᵀ (N, M) and xᵀ (K, M)) with the shipped and with the best tiles, from the
    sweep's transposed rows; None when the sweep has no row for one of them."""
    by_shape = {(r["R"], r["C"]): r for r in rows if r["layout"] == "transposed"}
    dy_t, x_t = by_shape.get((N, M)), by_shape.get((K, M))
    if dy_t is None or x_t is None:
        return None
    out = {"M": M, "K": K, "N": N, "bf16_us": bf16_us, "fp8_gemm_us": fp8_gemm_us}
    for which in ("shipped", "best"):
        quant_us = dy_t[f"{which}_us"] + x_t[f"{which}_us"]
        out[f"quant_{which}_us"] = quant_us
        out[f"speedup_{which}"] = bf16_us / (fp8_gemm_us + quant_us)
    return out


def time_weight_grads(rows: list[dict], gemms: list[tuple[int, int, int]]) -> list[dict]:
    """weight_grad_outlook of each (M, K, N) in ``gemms``, its GEMMs timed here by CUDA-graph replay."""
    from loka_trainer.kernels.backends_scaled_mm import scaled_mm_nt
    from loka_trainer.kernels.triton_quant import quantize_rowwise_fused
    from loka_trainer.timing import cuda_graph_us
    out = []
    for M, K, N in gemms:
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        (qa, sa), (qb, sb) = quantize_rowwise_fused(dy.t()), quantize_rowwise_fused(x.t())
        bf16_us = cuda_graph_us(lambda: dy.t() @ x, rep_ms=10, replays=5)
        fp8_us = cuda_graph_us(lambda: scaled_mm_nt(qa, sa, qb, sb, fast_accum=True), rep_ms=10, replays=5)
        row = weight_grad_outlook(M, K, N, rows, bf16_us, fp8_us)
        if row is not None:
            out.append(row)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['R']}x{r['C']}\n{r['layout']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 3.8))
    for i, (key, name) in enumerate([("shipped_tbps", "shipped tile"), ("best_tbps", "best tile"),
                                     ("inductor_tbps", "inductor")]):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[key] for r in rows], width=0.27, label=name)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("TB/s (least bytes moved / time)")
    ax.set_title("rowwise FP8 quantizer of t (R, C), bf16 in", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=writable_dir)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="R x C of a")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_quant_tiles times GPU kernels: no CUDA device here")
    from scripts.provenance import provenance
    args.out.mkdir(parents=True, exist_ok=True)
    meta, rows = provenance(), []
    for shape in args.shapes:
        R, C = (int(v) for v in shape.split("x"))
        for layout in args.layouts:
            rows.append(sweep_shape(*((R, C) if layout == "row-major" else (C, R)), layout))
            r = rows[-1]
            print(f"{r['R']}x{r['C']} {layout}: shipped {r['shipped']} {r['shipped_us']:.1f} µs, best {r['best']} "
                  f"{r['best_us']:.1f} µs, inductor {r['inductor_us']:.1f} µs", flush=True)
            json.dump({"meta": meta, "rows": rows}, open(args.out / "sweep_quant_tiles.json", "w"), indent=1)
    wgrads = time_weight_grads(rows, WGRAD_GEMMS)
    json.dump({"meta": meta, "rows": rows, "weight_grads": wgrads},
              open(args.out / "sweep_quant_tiles.json", "w"), indent=1)
    plot(rows, args.out / "sweep_quant_tiles.png")
    print(f"\n{'t (R x C)':>12} {'layout':>10} {'shipped':>18} {'µs':>7} {'TB/s':>5} {'best':>18} {'µs':>7} {'TB/s':>5}"
          f" {'inductor µs':>11} {'TB/s':>5}")
    for r in rows:
        print(f"{r['R']:>6}x{r['C']:<5} {r['layout']:>10} {r['shipped']:>18} {r['shipped_us']:7.1f} "
              f"{r['shipped_tbps']:5.2f} {r['best']:>18} {r['best_us']:7.1f} {r['best_tbps']:5.2f} "
              f"{r['inductor_us']:11.1f} {r['inductor_tbps']:5.2f}{'' if r['inductor_equal'] else ' (not equal)'}")
    print(f"\n{'weight grad M x K x N':>22} {'bf16 µs':>8} {'fp8 GEMM':>8} {'+ quant shipped':>15} {'x bf16':>6} "
          f"{'+ quant best':>12} {'x bf16':>6}")
    for w in wgrads:
        print(f"{w['M']:>8}x{w['K']}x{w['N']:<6} {w['bf16_us']:8.1f} {w['fp8_gemm_us']:8.1f} "
              f"{w['quant_shipped_us']:15.1f} {w['speedup_shipped']:6.2f} {w['quant_best_us']:12.1f} "
              f"{w['speedup_best']:6.2f}")


if __name__ == "__main__":
    main()
