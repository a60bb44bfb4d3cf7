"""Host time of the rowwise FP8 quantizer inside a compiled graph: ``loka::quant_rowwise`` (a ``triton_op``: inductor
launches the kernel from its own generated code) against the same kernel behind a ``custom_op`` (our Python runs at
every call).

    python -m benchmarks.quant_op_host_time_gpu OUT.json [--calls 40] [--shape 8192x1024]

A compiled function quantizes ``--calls`` different (R, C) BF16 tensors, as one LoKA training step does (43
``loka::quant_rowwise`` calls in the profiled wukong_h200 forward). Host µs per call = the wall time of the compiled
function's return (no synchronization inside) divided by ``--calls``, median of 50 calls after warm-up; GPU µs per
call by CUDA-graph replay of one eager call and of the compiled function. The results of the variants must be
bitwise equal. Prints a table last and writes JSON (date, device, command).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from loka_trainer.arg_types import positive_int, writable_file


def custom_op_quantizer():
    """The quantizer as a ``custom_op`` (opaque to inductor: ``quantize_rowwise_fused`` runs at every call)."""
    from loka_trainer.kernels.triton_quant import quantize_rowwise_fused

    @torch.library.custom_op("lokabench::quant_rowwise_custom", mutates_args=())
    def quant(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rowwise_fused(t, torch.float8_e4m3fn)

    @quant.register_fake
    def _(t):
        return t.new_empty(t.shape, dtype=torch.float8_e4m3fn), t.new_empty((t.shape[0], 1), dtype=torch.float32)

    return quant


def host_us_per_call(fn, xs, calls: int) -> float:
    for _ in range(5):
        fn(xs)
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(xs)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / calls * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=writable_file)
    ap.add_argument("--calls", type=positive_int, default=40)
    ap.add_argument("--shape", default="8192x1024")
    args = ap.parse_args(argv)
    from triton.testing import do_bench_cudagraph

    from loka_trainer.kernels.triton_quant import quant_rowwise

    R, C = (int(v) for v in args.shape.split("x"))
    xs = [torch.randn(R, C, device="cuda", dtype=torch.bfloat16) for _ in range(args.calls)]
    variants = {"custom_op": custom_op_quantizer(), "loka_triton_op": quant_rowwise}
    rows, reference = [], None
    for name, op in variants.items():
        def step(xs, op=op):
            return [op(x) for x in xs]
        row = {"variant": name}
        try:
            compiled = torch.compile(step)
            out = compiled(xs)
            reference = reference or out
            row["bitwise_equal"] = all(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
                                       and torch.equal(a[1], b[1]) for a, b in zip(out, reference))
            row["host_us_compiled"] = host_us_per_call(compiled, xs, args.calls)
            row["host_us_eager"] = host_us_per_call(step, xs, args.calls)
            row["gpu_us_eager"] = do_bench_cudagraph(lambda op=op: op(xs[0])) * 1e3
            row["gpu_us_compiled"] = do_bench_cudagraph(lambda: compiled(xs)) * 1e3 / args.calls
        except Exception as e:  # noqa: BLE001 -- a variant inductor cannot compile is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        torch._dynamo.reset()
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "command": " ".join(["python -m benchmarks.quant_op_host_time_gpu",
                                                               *sys.argv[1:]]),
              "shape": [R, C], "calls": args.calls, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'variant':>14} {'host µs compiled':>17} {'host µs eager':>14} {'GPU µs compiled':>16} {'eager':>6}  equal")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:>14}  error: {r['error']}")
        else:
            print(f"{r['variant']:>14} {r['host_us_compiled']:17.1f} {r['host_us_eager']:14.1f}"
                  f" {r['gpu_us_compiled']:16.1f} {r['gpu_us_eager']:6.1f}  {r['bitwise_equal']}")


if __name__ == "__main__":
    main()
