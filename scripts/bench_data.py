"""How fast the train data pipeline makes batches on this host: is it faster than the training step?

    python -m scripts.bench_data --out DIR [--threads 1 4] [--workers 1 2 4] [--batches 10] -- \
        model=interformer_h200 data.batch_size=4096

Builds the train stream of the composed config (train.py's Hydra overrides after ``--``) as train.py does, with
``data.workers`` = each of ``--workers`` (1: one background thread on the process's ``--threads`` intra-op threads;
more: that many worker processes of one torch thread each; a Criteo file's workers each read it all and parse every
N-th batch), and takes its batches as fast as they come: ms per batch over ``--batches`` batches after the first
``workers`` (their one-off set-up and head start left out). Prints ms per batch and examples/s per row; writes
``DIR/data_speed.json``.
Compare ms per batch with the step time train.py logs (``examples_per_s``, ``data_wait_ms`` in ``metrics.jsonl``):
a pipeline slower than the step makes the loop wait for data.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from loka_trainer.arg_types import positive_int, writable_dir
from loka_trainer.cli import compose_config
from loka_trainer.config import register_schemas, to_run_config
from loka_trainer.data import DataConfig, build_stream
from scripts.provenance import provenance
from scripts.result_files import write_result


def batch_ms(data: DataConfig, *, threads: int, workers: int, batches: int) -> dict:
    """{"threads", "workers", "ms_per_batch", "examples_per_s"} of the train stream of ``data`` made by ``workers``
    (one thread, or worker processes) in a process of ``threads`` torch threads."""
    torch.set_num_threads(threads)
    data = dataclasses.replace(data, workers=workers, prefetch=workers)  # one batch ahead per worker
    stream = build_stream(data, split="train", rank=0, world_size=1)
    try:
        for _ in range(workers):  # every worker's first batch: set-up, and made before the clock starts
            next(stream)
        began = time.perf_counter()
        for _ in range(batches):
            next(stream)
        ms = 1000.0 * (time.perf_counter() - began) / batches
    finally:
        stream.close()
    return {"threads": threads, "workers": workers, "ms_per_batch": ms, "examples_per_s": data.batch_size / ms * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_dir, required=True)
    ap.add_argument("--threads", type=positive_int, nargs="+", default=[1, torch.get_num_threads()])
    ap.add_argument("--workers", type=positive_int, nargs="+", default=[1])
    ap.add_argument("--batches", type=positive_int, default=10)
    ap.add_argument("overrides", nargs="*", help="train.py's Hydra overrides (after --)")
    args = ap.parse_args()
    register_schemas()
    composed = compose_config("config", args.overrides)
    data = to_run_config(composed.cfg, composed.choices).data
    rows = [batch_ms(data, threads=t, workers=w, batches=args.batches)
            for t in dict.fromkeys(args.threads) for w in dict.fromkeys(args.workers)]
    write_result(args.out / "data_speed.json", {**provenance(), "overrides": args.overrides,
                                                  "batches": args.batches, "rows": rows})
    print(f"{'threads':>8}  {'workers':>8}  {'ms per batch':>12}  {'examples/s':>11}")
    for row in rows:
        print(f"{row['threads']:>8}  {row['workers']:>8}  {row['ms_per_batch']:>12.1f}  "
              f"{row['examples_per_s']:>11,.0f}")


if __name__ == "__main__":
    main()
