"""Offline LoKA Probe analysis: per-layer MERE and speedup of every available GEMM backend.

    python -m loka_trainer.probe.report STATS [--num-samples 50] [--threshold 0.2] [--min-speedup 1.05]
                                              [--device cuda|cpu] [--rows M] [--seed 0] [--zero-floor 0.01]
                                              [--operand-dtype bfloat16|float32] [--out-dir DIR]
                                              [--kernel module:function ...]

For each layer in STATS (a statistics directory holding stats.pt, or the stats file itself) and each backend
of ``loka_trainer.kernels.backends.available_backends`` that supports the layer's shape (M rows per call, K in,
N out), and each user kernel ``--kernel module:function`` (a callable ``(x (M, K), w (N, K)) -> y (M, N)``
computing y ~ x @ w.T, imported like ``module.function``):
  mere         MERE of backend.forward(x, w) vs the fp32 reference over N pairs sampled from the learned
               statistics (x ~ N(mu, Sigma) row-wise, w ~ MN(M, U, V)), both cast to --operand-dtype (the
               training's compute dtype) before the kernel and the reference see them (see mere.py);
  mere_normal  the same with standard-normal x and w (what ordinary kernel tests use), for contrast;
  flushed      mean over the learned pairs of the fraction of x's or w's nonzero values (the larger) that the
               backend's forward FP8 cast sets to zero (flush.py; null for bf16 and user kernels). The samples
               are Gaussian, so a channel that is always large shows here, rare spikes do not: Dispatch measures
               it again on a real calibration batch;
  speedup      median time of bf16 forward / this backend's forward at (M, K, N) with bf16 operands
               on --device (null if it could not be timed);
  unsafe       mere >= threshold;  not_worth_it   speedup is null or <= min_speedup.
A kernel that is fine on normal inputs but not on learned ones (the paper's Table V) shows a learned/normal
MERE ratio well above the built-in backends'; each user kernel's ratio is printed per layer. Writes
report.json (the file Dispatch reads), report.md and report.png to --out-dir (default: the statistics'
directory; created when missing). See mere.py for how MERE treats reference values near zero. Timings on a CPU
say nothing about GPU speed. Bad input (stats file, --kernel, options) -> one ``error:`` line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from loka_trainer.atomic_files import atomic_write_text
from loka_trainer.probe.activation import moments_from_state
from loka_trainer.probe.flush import gemm_flushed_fraction
from loka_trainer.probe.mere import (DEFAULT_ZERO_FLOOR, OPERAND_DTYPES, GemmFn, accumulate_mere, median_time,
                                     operands)
from loka_trainer.probe.sampling import activation_factor, sample_activations, sample_weight, weight_factors
from loka_trainer.probe.stats_io import load_stats
from loka_trainer.output_dirs import unwritable_reason
from loka_trainer.user_code import import_callable

REPORT_VERSION = 1
BASELINE = "bf16"


class ReportInputError(ValueError):
    """Bad user input to the report (a --kernel spec, a kernel that fails, an option): one line, exit 2."""


class UserKernel:
    """A user's ``(x, w) -> y`` GEMM shown beside the built-in backends; named by its ``module:function`` spec.
    A kernel that raises or returns the wrong shape is a ReportInputError naming the kernel and the shape."""

    def __init__(self, name: str, fn: GemmFn):
        self.name, self._fn = name, fn

    def supports(self, M: int, K: int, N: int) -> bool:
        return True

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        try:
            y = self._fn(x, w)
        except Exception as exc:  # noqa: BLE001 - the user's code: report it in one line
            raise ReportInputError(f"--kernel {self.name} failed at M×K×N={x.shape[0]}×{x.shape[1]}×{w.shape[0]}: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        expected = (x.shape[0], w.shape[0])
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != expected:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ReportInputError(f"--kernel {self.name} returned {got}, expected a tensor of shape {expected}")
        return y


def load_user_kernel(spec: str) -> UserKernel:
    """``module:function`` -> UserKernel; anything unusable is a one-line ReportInputError."""
    try:
        fn = import_callable(spec, option="--kernel", expects="a callable (x, w) -> y")
    except ValueError as exc:
        raise ReportInputError(str(exc)) from None
    return UserKernel(spec, fn)


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


def recording_flush(pairs: Iterator[tuple[torch.Tensor, torch.Tensor]], backends: dict,
                    sums: dict[str, Optional[float]], *,
                    operand_dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs x (M, K), w (N, K), passed on unchanged; on the way, each backend's forward flushed fraction of the
    pair (both cast to ``operand_dtype``; ``flush.gemm_flushed_fraction``) is added to ``sums[name]`` (None stays
    None: the backend declares no FP8 cast)."""
    for x, w in pairs:
        xo, wo = operands(x, w, operand_dtype)
        cache: dict = {}
        for name, backend in backends.items():
            fraction = gemm_flushed_fraction(backend, "forward", {"a": xo, "b": wo}, cache=cache)
            if fraction is not None:
                sums[name] = (sums.get(name) or 0.0) + fraction
        yield x, w


def time_backends(backends: dict, shape: dict[str, int], *, device: torch.device, generator: torch.Generator,
                  operand_dtype: torch.dtype = torch.bfloat16) -> dict[str, Optional[float]]:
    """Speedup of each backend's forward over bf16 at this shape (operands in the training's dtype)."""
    x = torch.randn(shape["M"], shape["K"], generator=generator, device=device).to(operand_dtype)
    w = torch.randn(shape["N"], shape["K"], generator=generator, device=device).to(operand_dtype)
    seconds = {}
    for name, backend in backends.items():
        try:
            seconds[name] = median_time(backend.forward, x, w)
        except ReportInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is reported, not fatal
            tqdm.write(f"warning: timing {name} at {shape} failed ({type(exc).__name__}: {exc}); speedup null")
            seconds[name] = None
    base = seconds.get(BASELINE)
    return {name: (base / t if base and t else None) for name, t in seconds.items()}


def analyze_layer(layer: dict, backends: dict, *, num_samples: int, threshold: float, min_speedup: float,
                  device: torch.device, rows: Optional[int] = None, seed: int = 0,
                  zero_floor: float = DEFAULT_ZERO_FLOOR, operand_dtype: torch.dtype = torch.bfloat16,
                  timing: bool = True) -> dict:
    """One report.json layer entry: shape, representation and per-backend candidates."""
    shape = layer_shape(layer, rows)
    usable = {n: b for n, b in backends.items() if b.supports(shape["M"], shape["K"], shape["N"])}
    kernels = {n: b.forward for n, b in usable.items()}
    generator = torch.Generator(device=device).manual_seed(seed)
    flushed: dict[str, Optional[float]] = {}
    pairs = learned_pairs(layer, num_samples=num_samples, rows=shape["M"], device=device, generator=generator)
    learned = accumulate_mere(recording_flush(pairs, usable, flushed, operand_dtype=operand_dtype), kernels,
                              zero_floor=zero_floor, operand_dtype=operand_dtype)
    normal = accumulate_mere(normal_pairs(shape, num_samples=num_samples, device=device, generator=generator),
                             kernels, zero_floor=zero_floor, operand_dtype=operand_dtype)
    speedups = time_backends(usable, shape, device=device, generator=generator,
                             operand_dtype=operand_dtype) if timing else {}
    candidates = {}
    for name in usable:
        speedup = speedups.get(name)
        candidates[name] = {"mere": learned[name], "mere_normal": normal[name],
                            "flushed": None if flushed.get(name) is None else flushed[name] / num_samples,
                            "speedup": speedup,
                            "unsafe": bool(learned[name] >= threshold),
                            "not_worth_it": bool(speedup is None or speedup <= min_speedup)}
    representation = f"activation:{layer['activation'].get('representation', 'full')};" \
                     f"weight:{layer['weight'].get('representation', 'U:full,V:full')}"
    return {"shape": shape, "representation": representation, "candidates": candidates}


def build_report(stats: dict, backends: dict, *, device: torch.device, num_samples: int = 50,
                 threshold: float = 0.2, min_speedup: float = 1.05, rows: Optional[int] = None, seed: int = 0,
                 zero_floor: float = DEFAULT_ZERO_FLOOR, operand_dtype: torch.dtype = torch.bfloat16,
                 timing: bool = True) -> dict:
    """The whole report.json dict (format fixed by the Dispatch contract, version 1)."""
    layers = {}
    bar = tqdm(stats["layers"].items(), desc="probe report", unit="layer", disable=None)  # on a terminal only
    for index, (fqn, layer) in enumerate(bar):
        layers[fqn] = analyze_layer(layer, backends, num_samples=num_samples, threshold=threshold,
                                    min_speedup=min_speedup, device=device, rows=rows, seed=seed + index,
                                    zero_floor=zero_floor, operand_dtype=operand_dtype, timing=timing)
    dtype_name = next(n for n, d in OPERAND_DTYPES.items() if d == operand_dtype)
    return {"version": REPORT_VERSION, "device": describe_device(device), "num_samples": num_samples,
            "threshold": threshold, "min_speedup": min_speedup, "zero_floor": zero_floor,
            "operand_dtype": dtype_name, "layers": layers}


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return str(device)


def write_report(report: dict, out_dir: Path) -> list[Path]:
    """report.json, report.md, report.png in out_dir; returns the paths written. Each file is replaced whole
    (``atomic_files``): a failure or a kill while one is written leaves the earlier one as it was."""
    from loka_trainer.probe.report_render import render_markdown, render_plot

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md", out_dir / "report.png"]
    atomic_write_text(paths[0], json.dumps(report, indent=2) + "\n")
    atomic_write_text(paths[1], render_markdown(report))
    render_plot(report, paths[2])
    return paths


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loka_trainer.probe.report", description=__doc__.split("\n")[0])
    parser.add_argument("stats_dir", type=Path, help="directory holding stats.pt (e.g. RUN_DIR/probe), or the file")
    parser.add_argument("--num-samples", type=int, default=50, help="sampled input-weight pairs per layer")
    parser.add_argument("--threshold", type=float, default=0.2, help="MERE at or above this is unsafe")
    parser.add_argument("--min-speedup", type=float, default=1.05, help="speedup at or below this is not worth it")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=None, help="override M (rows per call) for every layer")
    parser.add_argument("--zero-floor", type=float, default=DEFAULT_ZERO_FLOOR,
                        help="MERE denominator floor, as a fraction of mean |ref|")
    parser.add_argument("--operand-dtype", choices=sorted(OPERAND_DTYPES), default="bfloat16",
                        help="dtype the kernels' operands have in training (precision.compute_dtype)")
    parser.add_argument("--backends", nargs="*", default=None, help="subset of backend names (default: all)")
    parser.add_argument("--kernel", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="also test this (x, w) -> y GEMM (y ~ x @ w.T); repeatable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default: the statistics' directory (created when missing)")
    return parser.parse_args(argv)


def select_backends(device: torch.device, names: Optional[list[str]]) -> dict:
    """Available backends on device (bf16 always first), optionally restricted to ``names``."""
    from loka_trainer.kernels.backends import available_backends  # kernels import torchao etc.: keep lazy

    backends = available_backends(device)
    if names:
        unknown = sorted(set(names) - set(backends))
        if unknown:
            raise ReportInputError(f"--backends: {unknown} not available on {device}; valid: {sorted(backends)}")
        backends = {n: b for n, b in backends.items() if n in names or n == BASELINE}
    return backends


def _check_options(args: argparse.Namespace) -> None:
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise ReportInputError(f"--device {args.device!r}: {str(exc).splitlines()[0]}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ReportInputError(f"--device {args.device!r}: no CUDA device is available here (use --device cpu)")
    if args.num_samples < 1:
        raise ReportInputError(f"--num-samples must be >= 1, got {args.num_samples}")
    if not (args.threshold > 0 and args.min_speedup > 0):
        raise ReportInputError(f"--threshold and --min-speedup must be > 0, got {args.threshold}, {args.min_speedup}")
    if args.rows is not None and args.rows < 1:
        raise ReportInputError(f"--rows must be >= 1, got {args.rows}")
    if not 0.0 <= args.zero_floor < float("inf"):
        raise ReportInputError(f"--zero-floor must be a finite number >= 0, got {args.zero_floor}")
    out_dir = report_dir(args)
    if (reason := unwritable_reason(out_dir)) is not None:  # else it fails after the whole report was computed
        named = f"--out-dir {out_dir}" if args.out_dir is not None else f"the statistics' directory {out_dir}"
        raise ReportInputError(f"{named}: cannot write there ({reason})")


def report_dir(args: argparse.Namespace) -> Path:
    """Where the report goes: ``--out-dir``, else the statistics directory (a stats file's own directory)."""
    if args.out_dir is not None:
        return Path(args.out_dir)
    stats = Path(args.stats_dir)
    return stats.parent if stats.is_file() else stats


def user_kernel_lines(report: dict) -> list[str]:
    """One line per (user kernel, layer): learned and normal MERE and their ratio."""
    lines = []
    for fqn, layer in report["layers"].items():
        for name, c in layer["candidates"].items():
            if ":" not in name:  # built-in backends have plain names; user kernels are module:function
                continue
            ratio = f"{c['mere'] / c['mere_normal']:.2f}x" if c["mere_normal"] > 0 else "n/a"
            lines.append(f"kernel {name} on {fqn}: MERE {c['mere']:.4g} on learned inputs, {c['mere_normal']:.4g} "
                         f"on normal inputs (learned/normal {ratio}){' UNSAFE' if c['unsafe'] else ''}")
    return lines


def _run(args: argparse.Namespace) -> tuple[dict, list[Path]]:
    _check_options(args)
    device = torch.device(args.device)
    user_kernels = {spec: load_user_kernel(spec) for spec in args.kernel}
    try:
        stats = load_stats(args.stats_dir)
    except ValueError as exc:  # the file and the reason, one line
        raise ReportInputError(str(exc)) from None
    backends = {**select_backends(device, args.backends), **user_kernels}
    report = build_report(stats, backends, device=device, num_samples=args.num_samples, threshold=args.threshold,
                          min_speedup=args.min_speedup, rows=args.rows, seed=args.seed, zero_floor=args.zero_floor,
                          operand_dtype=OPERAND_DTYPES[args.operand_dtype])
    try:
        paths = write_report(report, report_dir(args))
    except OSError as exc:  # e.g. --out-dir not writable
        raise ReportInputError(f"cannot write the report: {type(exc).__name__}: {exc}") from None
    return report, paths


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse_args(argv)
    try:
        report, paths = _run(args)
    except ReportInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in user_kernel_lines(report):
        print(line)
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
