"""How fast the train data pipeline makes batches on this host: is it faster than the training step?

    python -m scripts.bench_data --out DIR [--threads 1 4] [--batches 10] -- model=interformer_h200 \
        data.batch_size=4096

Builds the train stream of the composed config (train.py's Hydra overrides after ``--``) as train.py does, without
prefetching (``data.prefetch=0``: the background thread would hide the cost measured here), and times ``--batches``
batches after a first one, for each torch thread count in ``--threads`` (train.py's background thread uses the
process's intra-op threads). Prints ms per batch and examples/s per thread count; writes ``DIR/data_speed.json``.
Compare ms per batch with the step time train.py logs (``examples_per_s``, ``data_wait_ms`` in ``metrics.jsonl``):
a pipeline slower than the step makes the loop wait for data.
"""
from __future__ import annotations

import argparse
import time

import torch

from loka_trainer.arg_types import positive_int, writable_dir
from loka_trainer.cli import compose_config
from loka_trainer.config import register_schemas, to_run_config
from loka_trainer.data import DataConfig, build_stream
from scripts.provenance import provenance
from scripts.result_files import write_result


def batch_ms(data: DataConfig, *, threads: int, batches: int) -> dict:
    """{"ms_per_batch", "examples_per_s"} of the train stream of ``data`` at ``threads`` torch threads."""
    torch.set_num_threads(threads)
    stream = iter(build_stream(data, split="train", rank=0, world_size=1))
    next(stream)  # the first batch pays one-off set-up
    began = time.perf_counter()
    for _ in range(batches):
        next(stream)
    ms = 1000.0 * (time.perf_counter() - began) / batches
    return {"ms_per_batch": ms, "examples_per_s": data.batch_size / ms * 1000.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_dir, required=True)
    ap.add_argument("--threads", type=positive_int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--batches", type=positive_int, default=10)
    ap.add_argument("overrides", nargs="*", help="train.py's Hydra overrides (after --)")
    args = ap.parse_args()
    register_schemas()
    composed = compose_config("config", [*args.overrides, "data.prefetch=0"])
    data = to_run_config(composed.cfg, composed.choices).data
    rows = {str(t): batch_ms(data, threads=t, batches=args.batches) for t in dict.fromkeys(args.threads)}
    write_result(args.out / "data_speed.json", {**provenance(), "overrides": args.overrides,
                                                  "batches": args.batches, "threads": rows})
    print(f"{'threads':>8}  {'ms per batch':>12}  {'examples/s':>11}")
    for threads, row in rows.items():
        print(f"{threads:>8}  {row['ms_per_batch']:>12.1f}  {row['examples_per_s']:>11,.0f}")


if __name__ == "__main__":
    main()
