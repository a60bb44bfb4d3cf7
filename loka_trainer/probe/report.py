"""Offline LoKA Probe analysis: per-layer MERE and speedup of every available GEMM backend.

    python -m loka_trainer.probe.report STATS_DIR [--num-samples 50] [--threshold 0.2] [--min-speedup 1.05]
                                                  [--device cuda|cpu] [--rows M] [--seed 0]

For each layer in STATS_DIR/stats.pt and each backend of ``loka_trainer.kernels.backends.available_backends``
that supports the layer's shape (M rows per call, K in, N out):
  mere         MERE of backend.forward(x, w) vs the fp32 reference over N pairs sampled from the learned
               statistics (x ~ N(mu, Sigma) row-wise, w ~ MN(M, U, V));
  mere_normal  the same with standard-normal x and w (what ordinary kernel tests use), for contrast;
  speedup      median time of bf16 forward / this backend's forward at (M, K, N) with bf16 operands
               on --device (null if it could not be timed);
  unsafe       mere >= threshold;  not_worth_it   speedup is null or <= min_speedup.
Writes STATS_DIR/report.json (the file Dispatch reads), report.md and report.png. See mere.py for how MERE
treats reference values near zero. Timings on a CPU say nothing about GPU speed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from loka_trainer.probe.activation import moments_from_state
from loka_trainer.probe.mere import DEFAULT_ZERO_FLOOR, accumulate_mere, median_time
from loka_trainer.probe.sampling import activation_factor, sample_activations, sample_weight, weight_factors
from loka_trainer.probe.stats_io import load_stats

REPORT_VERSION = 1
BASELINE = "bf16"


def layer_shape(layer: dict, rows: Optional[int] = None) -> dict[str, int]:
    """{"M", "K", "N"}: M = rows per forward call seen in training (or ``rows``), K = in, N = out features."""
    num_rows = rows or int(layer["activation"].get("rows_per_call") or 0) or 1024
    return {"M": num_rows, "K": int(layer["in_features"]), "N": int(layer["out_features"])}


def learned_pairs(layer: dict, *, num_samples: int, rows: int, device: torch.device,
                  generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """x (rows, K) fp32 ~ learned N(mu, Sigma); w (N, K) fp32 ~ learned MN(M, U, V)."""
    moments = moments_from_state({k: v.to(device) for k, v in layer["activation"].items()
                                  if isinstance(v, torch.Tensor)})
    act_factor = activation_factor(moments)
    weight = {k: layer["weight"][k].to(device) for k in ("mean", "u", "v")}
    lu, lv = weight_factors(weight["u"], weight["v"])
    for _ in range(num_samples):
        x = sample_activations(moments, rows, generator=generator, factor=act_factor)
        w = sample_weight(weight["mean"], lu, lv, generator=generator)
        yield x.float(), w.float()


def normal_pairs(shape: dict[str, int], *, num_samples: int, device: torch.device,
                 generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """x (M, K), w (N, K) standard normal fp32."""
    for _ in range(num_samples):
        x = torch.randn(shape["M"], shape["K"], generator=generator, device=device)
        w = torch.randn(shape["N"], shape["K"], generator=generator, device=device)
        yield x, w


def time_backends(backends: dict, shape: dict[str, int], *, device: torch.device,
                  generator: torch.Generator) -> dict[str, Optional[float]]:
    """Speedup of each backend's forward over bf16 at this shape (bf16 operands, as in training)."""
    x = torch.randn(shape["M"], shape["K"], generator=generator, device=device).to(torch.bfloat16)
    w = torch.randn(shape["N"], shape["K"], generator=generator, device=device).to(torch.bfloat16)
    seconds = {}
    for name, backend in backends.items():
        try:
            seconds[name] = median_time(backend.forward, x, w)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is reported, not fatal
            tqdm.write(f"warning: timing {name} at {shape} failed ({type(exc).__name__}: {exc}); speedup null")
            seconds[name] = None
    base = seconds.get(BASELINE)
    return {name: (base / t if base and t else None) for name, t in seconds.items()}


def analyze_layer(layer: dict, backends: dict, *, num_samples: int, threshold: float, min_speedup: float,
                  device: torch.device, rows: Optional[int] = None, seed: int = 0,
                  zero_floor: float = DEFAULT_ZERO_FLOOR, timing: bool = True) -> dict:
    """One report.json layer entry: shape, representation and per-backend candidates."""
    shape = layer_shape(layer, rows)
    usable = {n: b for n, b in backends.items() if b.supports(shape["M"], shape["K"], shape["N"])}
    kernels = {n: b.forward for n, b in usable.items()}
    generator = torch.Generator(device=device).manual_seed(seed)
    learned = accumulate_mere(learned_pairs(layer, num_samples=num_samples, rows=shape["M"], device=device,
                                            generator=generator), kernels, zero_floor=zero_floor)
    normal = accumulate_mere(normal_pairs(shape, num_samples=num_samples, device=device, generator=generator),
                             kernels, zero_floor=zero_floor)
    speedups = time_backends(usable, shape, device=device, generator=generator) if timing else {}
    candidates = {}
    for name in usable:
        speedup = speedups.get(name)
        candidates[name] = {"mere": learned[name], "mere_normal": normal[name], "speedup": speedup,
                            "unsafe": bool(learned[name] >= threshold),
                            "not_worth_it": bool(speedup is None or speedup <= min_speedup)}
    representation = f"activation:{layer['activation'].get('representation', 'full')};" \
                     f"weight:{layer['weight'].get('representation', 'U:full,V:full')}"
    return {"shape": shape, "representation": representation, "candidates": candidates}


def build_report(stats: dict, backends: dict, *, device: torch.device, num_samples: int = 50,
                 threshold: float = 0.2, min_speedup: float = 1.05, rows: Optional[int] = None, seed: int = 0,
                 zero_floor: float = DEFAULT_ZERO_FLOOR, timing: bool = True) -> dict:
    """The whole report.json dict (format fixed by the Dispatch contract, version 1)."""
    layers = {}
    for index, (fqn, layer) in enumerate(tqdm(stats["layers"].items(), desc="probe report", unit="layer")):
        layers[fqn] = analyze_layer(layer, backends, num_samples=num_samples, threshold=threshold,
                                    min_speedup=min_speedup, device=device, rows=rows, seed=seed + index,
                                    zero_floor=zero_floor, timing=timing)
    return {"version": REPORT_VERSION, "device": describe_device(device), "num_samples": num_samples,
            "threshold": threshold, "min_speedup": min_speedup, "layers": layers}


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return str(device)


def write_report(report: dict, out_dir: Path, *, zero_floor: float = DEFAULT_ZERO_FLOOR) -> list[Path]:
    """report.json, report.md, report.png in out_dir; returns the paths written."""
    from loka_trainer.probe.report_render import render_markdown, render_plot

    out_dir = Path(out_dir)
    paths = [out_dir / "report.json", out_dir / "report.md", out_dir / "report.png"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(render_markdown(report, zero_floor=zero_floor))
    render_plot(report, paths[2])
    return paths


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loka_trainer.probe.report", description=__doc__.split("\n")[0])
    parser.add_argument("stats_dir", type=Path, help="directory holding stats.pt (e.g. RUN_DIR/probe)")
    parser.add_argument("--num-samples", type=int, default=50, help="sampled input-weight pairs per layer")
    parser.add_argument("--threshold", type=float, default=0.2, help="MERE at or above this is unsafe")
    parser.add_argument("--min-speedup", type=float, default=1.05, help="speedup at or below this is not worth it")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=None, help="override M (rows per call) for every layer")
    parser.add_argument("--zero-floor", type=float, default=DEFAULT_ZERO_FLOOR,
                        help="MERE denominator floor, as a fraction of mean |ref|")
    parser.add_argument("--backends", nargs="*", default=None, help="subset of backend names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: STATS_DIR")
    return parser.parse_args(argv)


def select_backends(device: torch.device, names: Optional[list[str]]) -> dict:
    """Available backends on device (bf16 always first), optionally restricted to ``names``."""
    from loka_trainer.kernels.backends import available_backends  # kernels import torchao etc.: keep lazy

    backends = available_backends(device)
    if names:
        unknown = sorted(set(names) - set(backends))
        if unknown:
            raise ValueError(f"--backends: {unknown} not available on {device}; valid: {sorted(backends)}")
        backends = {n: b for n, b in backends.items() if n in names or n == BASELINE}
    return backends


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    if args.num_samples < 1:
        raise SystemExit("--num-samples must be >= 1")
    device = torch.device(args.device)
    try:
        stats = load_stats(args.stats_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backends = select_backends(device, args.backends)
    report = build_report(stats, backends, device=device, num_samples=args.num_samples, threshold=args.threshold,
                          min_speedup=args.min_speedup, rows=args.rows, seed=args.seed, zero_floor=args.zero_floor)
    for path in write_report(report, args.out_dir or args.stats_dir, zero_floor=args.zero_floor):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
