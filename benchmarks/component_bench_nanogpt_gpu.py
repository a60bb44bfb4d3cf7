"""GPU run of the Component Benchmark on a GPT-2-small-shaped nanoGPT (the paper's LLM example), no Hydra.

    python -m benchmarks.component_bench_nanogpt_gpu OUT_DIR
Writes OUT_DIR/bench_nanogpt.{csv,json,md} and OUT_DIR/bench_nanogpt_icicle.html (+ traces/ when tracing).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from loka_trainer.arg_types import require_cuda, writable_dir
from loka_trainer.bench import BenchOptions, ModuleProvider, run_bench, write_results
from loka_trainer.bench.examples import NanoGPT


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line; a folder that cannot be written is argparse's error, a machine without CUDA one
    ``error:`` line (exit status 2 for both), before anything runs."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.component_bench_nanogpt_gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=writable_dir, help="folder for the table, icicle, traces and snapshots")
    args = ap.parse_args(argv)
    require_cuda(ap)
    return args


def run(out_dir: Path) -> None:
    """Profile nanoGPT 124M on the GPU and write the results into ``out_dir``."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = NanoGPT(vocab=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    idx = torch.randint(0, 50304, (8, 1024))
    opts = BenchOptions(depth=3, trace=True, memory_snapshot=True, warmup=5, repeats=20)
    result = run_bench(ModuleProvider(model, idx).get_component(device), opts, out_dir=out_dir)
    for p in write_results(result, out_dir, opts.results, stem="bench_nanogpt", title="Component Benchmark: nanoGPT 124M"):
        print(p)
    print((out_dir / "bench_nanogpt.md").read_text())


def main(argv: Optional[list[str]] = None) -> None:
    run(parse_args(argv).out_dir)


if __name__ == "__main__":
    main()
