"""GPU run of the Component Benchmark on a GPT-2-small-shaped nanoGPT (the paper's LLM example), no Hydra.

    python -m benchmarks.component_bench_nanogpt_gpu OUT_DIR
Writes OUT_DIR/bench_nanogpt.{csv,json,md} and OUT_DIR/bench_nanogpt_icicle.html (+ traces/ when tracing).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from loka_trainer.bench import BenchOptions, ModuleProvider, run_bench, write_results
from loka_trainer.bench.examples import NanoGPT


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = NanoGPT(vocab=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    idx = torch.randint(0, 50304, (8, 1024))
    opts = BenchOptions(depth=3, trace=True, memory_snapshot=True, warmup=5, repeats=20)
    result = run_bench(ModuleProvider(model, idx).get_component(device), opts, out_dir=out_dir)
    for p in write_results(result, out_dir, opts.results, stem="bench_nanogpt", title="Component Benchmark: nanoGPT 124M"):
        print(p)
    print((out_dir / "bench_nanogpt.md").read_text())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
