"""The Component Benchmark workflow (paper Fig. 2): capture inputs, walk, preprocess, profile, estimate."""
from __future__ import annotations

import contextlib
import fnmatch
import os
import warnings
from pathlib import Path
from typing import Callable, ContextManager, Optional, Sequence, Union

import torch
from torch import nn
from tqdm import tqdm

from loka_trainer.bench.metrics import derive, lookup_peak, sum_children
from loka_trainer.bench.options import BenchOptions
from loka_trainer.bench.plugins import Component, Job, Preprocessor, Profiler, RunContext, make
from loka_trainer.bench.preprocessors import BatchReplicate, Precision, compute_dtype
from loka_trainer.bench.profilers import PROFILERS, judge
from loka_trainer.bench.results import earlier_run_set_aside, stderr_line
from loka_trainer.bench.tree import (CONTAINERS, BenchResult, ModuleInputs, Node, all_paths, build_nodes,
                                     capture_inputs, check_globs, module_paths, walk)
from loka_trainer.globs import unmatched
from loka_trainer.kernels.triton_env import triton_importable
from loka_trainer.timing import CUDA_BENCH_TIMERS, default_bench_timer


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; a CUDA device this machine lacks is a one-line ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"bench.device={name!r}: CUDA is not available on this machine; use bench.device=cpu "
                         "or auto")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"bench.device={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_timer(timer: str, device: torch.device) -> None:
    """A CUDA timer for a model on another device, or ``do_bench`` without triton, is a ValueError (else every
    module would fail to be timed and the table would say n/a throughout)."""
    if timer in CUDA_BENCH_TIMERS and device.type != "cuda":
        raise ValueError(f"bench.timer={timer!r} times CUDA work, but the model runs on {device.type}; "
                         f"use bench.timer=auto or wall")
    if timer == "do_bench" and not triton_importable():
        raise ValueError("bench.timer='do_bench' needs triton, which does not import here; use bench.timer=auto "
                         "or cuda_events")


def check_filters(model: nn.Module, opts: BenchOptions) -> None:
    """A ``bench.include`` glob that selects no profiled submodule, or a ``bench.exclude`` glob that names no
    submodule at all, is a ValueError naming the closest paths (else the run would measure nothing it was asked
    to, or everything it was asked not to). A ModuleList / ModuleDict is never called, so it is measured only
    through its entries: a glob naming only containers selects nothing. An exclude glob matching the root would
    leave nothing to measure. A module with several paths (a shared layer) is matched on each of them."""
    if dropping_root := [glob for glob in opts.exclude if fnmatch.fnmatchcase(opts.root_name, glob)]:
        raise ValueError(f"bench.exclude: {dropping_root} match(es) the root {opts.root_name!r}, which would drop "
                         f"every module; exclude submodules, e.g. '{opts.root_name}.NAME'")
    entries = walk(model, max_depth=opts.depth, root_name=opts.root_name, exclude=opts.exclude)
    paths_of = all_paths(model, opts.root_name)
    walked = [p for _, module, _ in entries if not isinstance(module, CONTAINERS) for p in paths_of[id(module)]]
    containers = [p for _, module, _ in entries if isinstance(module, CONTAINERS) for p in paths_of[id(module)]]
    only_containers = [glob for glob in unmatched(opts.include, walked) if not unmatched([glob], containers)]
    if only_containers:
        first = next(p for p in containers if fnmatch.fnmatchcase(p, only_containers[0]))
        raise ValueError(f"bench.include: {only_containers} name(s) only a ModuleList / ModuleDict, which is never "
                         f"called itself; name its entries, e.g. {first + '.*'!r}")
    check_globs("bench.include", opts.include, walked,
                scope=f"down to bench.depth={opts.depth}" + (" outside bench.exclude" if opts.exclude else ""))
    check_globs("bench.exclude", opts.exclude, module_paths(model, opts.root_name), scope="of the model")


def model_device(model: nn.Module, opts: BenchOptions) -> torch.device:
    """Where the model's parameters are; ``opts.device`` for a model without any."""
    first = next((p.device for p in model.parameters()), None)
    return first if first is not None else resolve_device(opts.device)


def device_scope(device: torch.device) -> ContextManager:
    """``device`` made the current CUDA device (for what uses the current one: Dispatch's GEMM timing, a plugin's
    ``device="cuda"``); a no-op for any other device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def make_context(opts: BenchOptions, device: torch.device, out_dir: Optional[Path]) -> RunContext:
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dtype = compute_dtype(opts.resolved_precision(device), device)
    return RunContext(device=device, device_name=device_name, compute_dtype=dtype,
                      peak=lookup_peak(device_name), warmup=opts.warmup, repeats=opts.repeats,
                      timer=default_bench_timer(device) if opts.timer == "auto" else opts.timer, out_dir=out_dir)


def default_plugins(opts: BenchOptions, device: torch.device) -> tuple[list[Preprocessor], list[Profiler]]:
    """The preprocessors and profilers named by ``opts`` (trace / memory snapshot appended when switched on)."""
    pre = [BatchReplicate(opts.replicate), Precision(opts.resolved_precision(device))]
    names = list(opts.profilers) + (["trace"] if opts.trace else []) + \
        (["memory_snapshot"] if opts.memory_snapshot else [])
    return pre, [make(PROFILERS, n, "bench.profilers") for n in names]


def _error_line(err: BaseException) -> str:
    """``Type: first line of the message``."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def join_errors(errors: Sequence[tuple[str, str]]) -> str:
    """One line for ``(profiler name, error line)`` pairs, profilers with the same error named together:
    ``latency_fwd, flops: OutOfMemoryError: ...; memory: RuntimeError: ...``."""
    by_error: dict[str, list[str]] = {}
    for name, line in errors:
        by_error.setdefault(line, []).append(name)
    return "; ".join(f"{', '.join(names)}: {line}" for line, names in by_error.items())


def _release(job: Job, ctx: RunContext) -> None:
    """After a failure: the module's gradients dropped and, on CUDA, the allocator's cached blocks freed."""
    job.module.zero_grad(set_to_none=True)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def _profile_node(node: Node, job: Job, ctx: RunContext, pre: Sequence[Preprocessor],
                  profilers: Sequence[Profiler]) -> None:
    """Preprocess ``job`` and run each profiler on it, into ``node``. A preprocessor that raises fails the node;
    a profiler that raises fails only its own columns (n/a): the others are kept, and the node is "failed" with
    each failing profiler and its error in ``node.error``. Any failure (OOM, an unreplayable input) leaves the
    run going on."""
    errors: list[tuple[str, str]] = []
    try:
        for p in pre:
            job = p.apply(job, ctx)
    except Exception as err:  # noqa: BLE001 -- nothing to profile without the prepared job
        errors.append((f"preprocessor {p.name}", _error_line(err)))
        _release(job, ctx)
    for prof in profilers if not errors else ():
        try:
            node.metrics.update(prof.profile(job, ctx, node.metrics))
        except Exception as err:  # noqa: BLE001 -- this profiler's columns only: n/a
            errors.append((prof.name, _error_line(err)))
            _release(job, ctx)
    if errors:
        node.status, node.error = "failed", join_errors(errors)
    node.notes.extend(job.notes)
    job.module.zero_grad(set_to_none=True)


def estimate_from_children(nodes: dict[str, Node]) -> None:
    """Bottom-up: a failed or unselected node's missing additive metrics become the sum of its children's."""
    for node in reversed(list(nodes.values())):
        if node.status == "ok" or not node.children:
            continue
        sums = sum_children([nodes[c].metrics for c in node.children])
        filled = [k for k, v in sums.items() if node.metrics.get(k) is None and v is not None]
        node.metrics.update({k: sums[k] for k in filled})
        if filled:
            node.status = "estimated"
            node.notes.append(f"estimated from children: {', '.join(filled)}")


def _captured_inputs(component: Component, entries: list[tuple[str, nn.Module, int]]) -> dict[str, ModuleInputs]:
    """Each walked module's inputs from one forward of the whole model; a forward that raises is one ValueError
    (its cause chained), since no module can be measured without the inputs it gets."""
    try:
        captured, _ = capture_inputs(component.model, component.inputs, entries)
    except Exception as err:  # noqa: BLE001 -- the user's model: report it in one line
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"the model's forward failed on the provider's input, so no module was measured: "
                         f"{type(err).__name__}: {first}") from err
    return captured


def run_bench(component: Component, opts: BenchOptions, *, out_dir: Optional[Union[str, os.PathLike]] = None,
              preprocessors: Optional[Sequence[Preprocessor]] = None,
              profilers: Optional[Sequence[Profiler]] = None,
              log: Callable[[str], None] = stderr_line) -> BenchResult:
    """Profile every submodule of ``component.model`` down to ``opts.depth``; returns the result tree.

    ``out_dir`` (a str or path): this run's folder, where the traces and memory snapshots go, when switched on.
    An earlier run's outputs there (traces, snapshots, result tables) move to ``out_dir/previous/<date>_<time>/``
    for this run, as the command line does (`earlier_run_set_aside`: ``log`` gets the line saying where), and move
    back if it raises.
    ``preprocessors`` / ``profilers`` default to those named in ``opts``; pass instances to add your own.
    A ``bench.include`` / ``bench.exclude`` glob that names no submodule, a timer this device lacks, or a model
    whose forward raises on ``component.inputs`` is a ValueError.
    """
    check_filters(component.model, opts)
    device = model_device(component.model, opts)
    check_timer(opts.timer, device)
    ctx = make_context(opts, device, None if out_dir is None else Path(out_dir))
    default_pre, default_prof = default_plugins(opts, device)
    pre = default_pre if preprocessors is None else list(preprocessors)
    profs = default_prof if profilers is None else list(profilers)
    entries = walk(component.model, max_depth=opts.depth, root_name=opts.root_name, exclude=opts.exclude)
    nodes = build_nodes(entries, include=opts.include, paths_of=all_paths(component.model, opts.root_name))
    modules = {path: module for path, module, _ in entries}
    set_aside = contextlib.nullcontext() if out_dir is None else earlier_run_set_aside(Path(out_dir), log)
    with set_aside, device_scope(device):
        captured = _captured_inputs(component, entries)
        for node in tqdm(list(nodes.values()), desc="bench", unit="module", disable=not opts.progress):
            if node.status == "estimated":
                continue
            if node.path not in captured:
                node.status, node.error = "failed", "not called during the captured forward"
                continue
            job = Job(node.path, modules[node.path], captured[node.path], component.batch_size)
            _profile_node(node, job, ctx, pre, profs)
    estimate_from_children(nodes)
    for node in nodes.values():
        node.judged_by = judge(modules[node.path], node.metrics.get("flops_fwd"))
        node.metrics.update(derive(node.metrics, peak=ctx.peak, compute_dtype=ctx.compute_dtype,
                                   judged_by=node.judged_by))
    if ctx.peak is None:
        warnings.warn(f"no stated peak for device {ctx.device_name!r}: MFU and bandwidth utilization are n/a",
                      stacklevel=2)
    return BenchResult(nodes=nodes, root=opts.root_name, device=str(device), device_name=ctx.device_name,
                       compute_dtype=ctx.compute_dtype, peak_name=None if ctx.peak is None else ctx.peak.name)
