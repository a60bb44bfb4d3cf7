"""A torch.profiler trace (Chrome trace JSON, as ``export_chrome_trace`` and TensorBoard's handler write it) split
per training step: each step's wall time and its GPU kernel time by kind (``profiling.kernels``).

A kernel belongs to the step whose ``ProfilerStep#N`` range (host timeline) holds its launch: the launch (a CUDA
runtime or driver call, e.g. ``cudaLaunchKernel``; ``cuLaunchKernelEx`` for Triton) and the kernel carry the same
``correlation`` id. So a kernel that runs after its step's host range ended (the GPU behind the host) still counts
for the step that launched it. The trainer names the phases of a step (``phase``: data, forward, backward,
optimizer, metrics, callbacks, eval, checkpoint); each step's host time and kernel time are also split by the phase
range that holds them (launches outside every phase: "unnamed"). Why by hand: torch's ``key_averages`` sums a whole
profiling window, not per step or phase.
"""
from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from typing import ContextManager, Optional

import torch
from torch.profiler import record_function

from loka_trainer.profiling.kernels import CATEGORIES, is_gpu_annotation, kernel_category

STEP_RANGE = re.compile(r"^ProfilerStep#(\d+)$")
PHASE_PREFIX = "loka."  # record_function names of the trainer's phases
UNNAMED = "unnamed"
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # host-side calls that launch GPU work
GPU_WORK_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # GPU-side events with a duration


def _span(e: dict) -> tuple[float, float]:
    """(start, end) in µs of a complete ("X") trace event."""
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))


def step_ranges(events: list[dict]) -> dict[int, tuple[float, float]]:
    """Profiler step index -> (start, end) in µs on the host timeline, from the ``ProfilerStep#N`` ranges."""
    ranges = {}
    for e in events:
        match = STEP_RANGE.match(str(e.get("name", "")))
        if match and e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation":
            ranges[int(match.group(1))] = _span(e)
    return ranges


def phase(name: str) -> str:
    """The record_function name of a trainer phase."""
    return PHASE_PREFIX + name


def phase_range(name: str) -> ContextManager:
    """The trainer's range around a phase: a ``record_function`` while a profiler records, else a no-op (a
    ``record_function`` costs microseconds of host time even with no profiler, on every step)."""
    if torch._C._autograd._profiler_enabled():  # NOTE: torch's own check (record_function's enter does not skip)
        return record_function(phase(name))
    return contextlib.nullcontext()


def phase_ranges(events: list[dict]) -> list[tuple[str, float, float]]:
    """(phase, start, end) in µs on the host timeline, from the trainer's ``phase`` ranges."""
    return [(str(e["name"])[len(PHASE_PREFIX):], *_span(e)) for e in events
            if e.get("ph") == "X" and e.get("cat") == "user_annotation"
            and str(e.get("name", "")).startswith(PHASE_PREFIX)]


def _step_of(ts: float, ranges: dict[int, tuple[float, float]]) -> Optional[int]:
    return next((step for step, (start, end) in ranges.items() if start <= ts < end), None)


def _phase_of(ts: float, phases: list[tuple[str, float, float]]) -> str:
    return next((name for name, start, end in phases if start <= ts < end), UNNAMED)


def split_steps(trace: dict, *, step_offset: int = 0, top: int = 10) -> list[dict]:
    """Per profiled step, in order: {"step": N + step_offset, "wall_ms", "gpu_ms", "<category>_ms" for every kernel
    kind, "top_kernels": [[name[:90], µs, calls], ...] (the ``top`` longest by total time)}. ``trace``: the parsed
    Chrome trace; ``step_offset``: the training step at which the profiler was started (its N counts from 0).
    Memory copies and sets count as "other"; GPU ranges of host annotations are not kernels and are skipped."""
    events = trace.get("traceEvents", [])
    ranges = step_ranges(events)
    phases = phase_ranges(events)
    launched = {}  # correlation id -> (step, phase) of its launch
    for e in events:
        correlation = e.get("args", {}).get("correlation")
        if e.get("cat") in LAUNCH_CATEGORIES and correlation is not None:
            ts = float(e["ts"])
            launched[correlation] = (_step_of(ts, ranges), _phase_of(ts, phases))
    ms = {step: dict.fromkeys(CATEGORIES, 0.0) for step in ranges}
    phase_ms = {step: defaultdict(lambda: [0.0, 0.0]) for step in ranges}  # phase -> [host ms, GPU ms]
    for name, start, end in phases:
        step = _step_of(start, ranges)
        if step is not None:
            phase_ms[step][name][0] += (end - start) / 1e3
    kernels: dict[int, dict[str, list[float]]] = {step: defaultdict(lambda: [0.0, 0]) for step in ranges}
    for e in events:
        if e.get("cat") not in GPU_WORK_CATEGORIES or is_gpu_annotation(str(e.get("name", ""))):
            continue
        step, at = launched.get(e.get("args", {}).get("correlation"), (None, UNNAMED))
        if step is None:
            continue
        name, dur = str(e.get("name", "")), float(e.get("dur", 0.0))
        category = kernel_category(name) if e["cat"] == "kernel" else "other"
        ms[step][category] += dur / 1e3
        phase_ms[step][at][1] += dur / 1e3
        entry = kernels[step][name[:90]]
        entry[0] += dur
        entry[1] += 1
    out = []
    for step in sorted(ranges):
        start, end = ranges[step]
        ranked = sorted(kernels[step].items(), key=lambda kv: -kv[1][0])[:top]
        out.append({"step": step + step_offset, "wall_ms": (end - start) / 1e3, "gpu_ms": sum(ms[step].values()),
                    **{f"{cat}_ms": v for cat, v in ms[step].items()},
                    "phases": {p: {"host_ms": host, "gpu_ms": gpu} for p, (host, gpu) in phase_ms[step].items()},
                    "top_kernels": [[name, round(us, 1), calls] for name, (us, calls) in ranked]})
    return out


def summary_line(step: dict) -> str:
    """One step of ``split_steps`` as a log line."""
    line = f"profile step {step['step']}: {step['wall_ms']:.2f} ms on the host"
    phases = ", ".join(f"{name} {times['host_ms']:.2f}" for name, times in step.get("phases", {}).items()
                       if times["host_ms"] > 0)
    if phases:
        line += f" ({phases})"
    if not step["top_kernels"]:
        return line  # no GPU work in the trace (a CPU run)
    parts = " + ".join(f"{cat} {step[f'{cat}_ms']:.2f}" for cat in CATEGORIES if step[f"{cat}_ms"] > 0)
    return f"{line}; GPU kernels {step['gpu_ms']:.2f} ms ({parts})"
