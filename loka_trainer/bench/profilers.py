"""Built-in profilers: latency (fwd, fwd+bwd), FLOPs, parameter bytes, peak memory, bytes moved, traces."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from loka_trainer.bench.plugins import Job, Profiler, RunContext
from loka_trainer.bench.tree import ModuleInputs, is_leaf
from loka_trainer.timing import BENCH_TIMERS

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def _tensors(x: Any) -> list[torch.Tensor]:
    """Tensors in a pytree, looking inside TorchRec KJT/KeyedTensor (``.values()``) and a Batch's fields."""
    out: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(x, is_leaf=is_leaf):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif callable(getattr(leaf, "values", None)) and hasattr(leaf, "keys"):
            values = leaf.values()
            out.extend([values] if isinstance(values, torch.Tensor) else [])
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out.extend(_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def with_grad_inputs(inputs: ModuleInputs) -> ModuleInputs:
    """Floating tensors become fresh leaves that require grad, so parameter-free modules have a backward too."""
    def prep(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x

    return ModuleInputs(pytree.tree_map(prep, inputs.args, is_leaf=is_leaf),
                        pytree.tree_map(prep, inputs.kwargs, is_leaf=is_leaf))


# torch's error for an in-place op on a leaf that requires grad (ReLU(inplace=True) on the prepared input)
IN_PLACE_ON_LEAF = "leaf Variable that requires grad"
IN_PLACE_NOTE = "writes its input in place: each fwd+bwd call runs on a copy of the input (the copy is timed too)"


def _copied(inputs: ModuleInputs) -> ModuleInputs:
    """Each tensor that requires grad replaced by its copy: a non-leaf an in-place op may write, whose gradient
    still reaches the original."""
    def copy(x: Any) -> Any:
        return x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x

    return ModuleInputs(pytree.tree_map(copy, inputs.args, is_leaf=is_leaf),
                        pytree.tree_map(copy, inputs.kwargs, is_leaf=is_leaf))


def _grad_outputs(job: Job, inputs: ModuleInputs) -> list[torch.Tensor]:
    """The output tensors of one call of ``job`` on ``inputs`` (autograd on) that carry a gradient."""
    with torch.enable_grad(), job.context():
        return [t for t in _tensors(inputs.call(job.module)) if t.requires_grad]


def _train_step_fn(job: Job) -> Optional[Callable[[], None]]:
    """A closure running forward + backward of ``job``, or None when its output carries no gradient.

    Each output's gradient is a dense tensor of ones of its shape, made once, as a training step's downstream
    layers hand back. Backpropagating ``out.sum()`` instead seeds a stride-0 (expanded) gradient, on which some
    backward kernels (a batched matmul on CPU) run several times slower than on the gradient a model passes.
    A module that writes its input in place runs on a copy of it per call (noted in ``job.notes``).
    """
    leaves = with_grad_inputs(job.inputs)
    copy_inputs = False
    try:
        outs = _grad_outputs(job, leaves)
    except RuntimeError as err:
        if IN_PLACE_ON_LEAF not in str(err):
            raise
        copy_inputs = True
        outs = _grad_outputs(job, _copied(leaves))
        if IN_PLACE_NOTE not in job.notes:
            job.notes.append(IN_PLACE_NOTE)
    if not outs:
        return None
    seeds = [torch.ones_like(o, memory_format=torch.contiguous_format) for o in outs]
    del outs

    def step() -> None:
        outs = _grad_outputs(job, _copied(leaves) if copy_inputs else leaves)
        torch.autograd.backward(outs, grad_tensors=seeds)

    return step


class LatencyForward(Profiler):
    """Median forward latency (no autograd graph) -> ``latency_fwd_ms``."""

    name = "latency_fwd"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        def fwd() -> None:
            with torch.no_grad():
                job.run()

        timer = BENCH_TIMERS[ctx.timer]
        return {"latency_fwd_ms": 1e-3 * timer(fwd, warmup=ctx.warmup, repeats=ctx.repeats, device=ctx.device)}


class LatencyForwardBackward(Profiler):
    """Median forward+backward latency (each output's gradient a dense tensor of ones) -> ``latency_fwd_bwd_ms``."""

    name = "latency_fwd_bwd"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        step = _train_step_fn(job)
        if step is None:
            job.notes.append("no output requires grad: fwd+bwd n/a")
            return {"latency_fwd_bwd_ms": None}
        timer = BENCH_TIMERS[ctx.timer]
        ms = 1e-3 * timer(step, warmup=ctx.warmup, repeats=ctx.repeats, device=ctx.device)
        job.module.zero_grad(set_to_none=True)
        return {"latency_fwd_bwd_ms": ms}


class Flops(Profiler):
    """FLOPs from ``FlopCounterMode`` in a separate eager pass (matmul/conv/attention only) -> ``flops_fwd``,
    ``flops_fwd_bwd``."""

    name = "flops"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            job.run()
        fwd = counter.get_total_flops()
        step = _train_step_fn(job)
        total = None
        if step is not None:
            with FlopCounterMode(display=False) as counter:
                step()
            total = counter.get_total_flops()
            job.module.zero_grad(set_to_none=True)
        return {"flops_fwd": float(fwd), "flops_fwd_bwd": None if total is None else float(total)}


def _unique_params_and_buffers(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers())


class ParamBytes(Profiler):
    """Static footprint (parameters + buffers) -> ``param_bytes``."""

    name = "params"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        return {"param_bytes": float(_nbytes(_unique_params_and_buffers(job.module)))}


class CudaPeak(NamedTuple):
    """Allocator bytes around one call: ``peak`` (high-water mark during it), ``before`` (allocated when it
    started), ``peak_reserved`` (high-water mark of what the caching allocator held from the device)."""

    peak: int
    before: int
    peak_reserved: int


def cuda_peak_memory(fn: Callable[[], Any], device: torch.device) -> CudaPeak:
    """Run ``fn`` once between ``reset_peak_memory_stats`` and ``max_memory_allocated`` on CUDA ``device``."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return CudaPeak(torch.cuda.max_memory_allocated(device), before, torch.cuda.max_memory_reserved(device))


class PeakMemory(Profiler):
    """Peak CUDA memory above the resident baseline during one fwd+bwd -> ``peak_mem_bytes`` (n/a off CUDA)."""

    name = "memory"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        if ctx.device.type != "cuda":
            return {"peak_mem_bytes": None}

        def step() -> None:  # built inside the measured call: its first forward is part of the peak
            run = _train_step_fn(job)
            if run is None:
                with torch.no_grad():
                    job.run()
            else:
                run()

        mem = cuda_peak_memory(step, ctx.device)
        job.module.zero_grad(set_to_none=True)
        return {"peak_mem_bytes": float(mem.peak - mem.before)}


def _embedding_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, EMBEDDING_TYPES)]


def _embedding_param_ids(module: nn.Module) -> set[int]:
    return {id(p) for m in _embedding_modules(module) for p in m.parameters()}


def judge(module: nn.Module, flops_fwd: Optional[float]) -> str:
    """``"bandwidth"`` for modules whose weights are all embedding tables or that do no counted FLOPs, else
    ``"compute"``; bandwidth-judged modules get MFU n/a (FLOP counters only see matmul/conv/attention)."""
    params = list(module.parameters())
    emb = _embedding_param_ids(module)
    if (params and all(id(p) in emb for p in params)) or flops_fwd == 0:
        return "bandwidth"
    return "compute"


class BytesMoved(Profiler):
    """Estimated HBM traffic of one forward -> ``bytes_moved``.

    Inputs + outputs + dense parameters once each, plus for every embedding lookup only the rows it reads
    (ids x dim x element size, from the lookups' real inputs) rather than whole tables. Intermediate
    activations are not counted, so this is a lower bound for composite modules.
    """

    name = "bandwidth"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        rows = [0]

        def hook(m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            # TorchRec's EmbeddingBagCollection passes its tables' ids by keyword (input=..., offsets=...)
            ids = args[0] if args else kwargs.get("input")
            if isinstance(ids, torch.Tensor):
                rows[0] += ids.numel() * m.weight.shape[1] * m.weight.element_size()

        handles = [m.register_forward_hook(hook, with_kwargs=True) for m in _embedding_modules(job.module)]
        try:
            with torch.no_grad():
                out = job.run()
        finally:
            for h in handles:
                h.remove()
        emb = _embedding_param_ids(job.module)
        dense = [p for p in job.module.parameters() if id(p) not in emb]
        moved = _nbytes(_tensors((job.inputs.args, job.inputs.kwargs))) + _nbytes(_tensors(out))
        return {"bytes_moved": float(moved + _nbytes(dense) + rows[0])}


def _artifact_dir(ctx: RunContext, kind: str, path: str) -> Optional[Path]:
    if ctx.out_dir is None:
        return None
    d = ctx.out_dir / kind / path
    d.mkdir(parents=True, exist_ok=True)
    return d


class Trace(Profiler):
    """A torch.profiler (Kineto) trace of one fwd+bwd, TensorBoard-openable (``tensorboard --logdir
    DIR/traces``) -> ``trace`` (folder), ``cpu_time_total_ms``, ``gpu_time_total_ms``."""

    name = "trace"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        out_dir = _artifact_dir(ctx, "traces", job.path)
        step = _train_step_fn(job) or (lambda: job.run())
        acts = [torch.profiler.ProfilerActivity.CPU]
        if ctx.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        handler = None if out_dir is None else torch.profiler.tensorboard_trace_handler(str(out_dir))
        sched = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
        with torch.profiler.profile(activities=acts, schedule=sched, on_trace_ready=handler) as prof:
            for _ in range(2):
                with torch.profiler.record_function(f"module/{job.path}"):
                    step()
                prof.step()
        job.module.zero_grad(set_to_none=True)
        events = prof.key_averages()
        top = [e for e in events if e.key == f"module/{job.path}"]
        cpu_ms = top[0].cpu_time_total / 1e3 if top else None
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 if ctx.device.type == "cuda" else None
        return {"trace": None if out_dir is None else str(out_dir), "cpu_time_total_ms": cpu_ms,
                "gpu_time_total_ms": gpu_ms}


class MemorySnapshot(Profiler):
    """A CUDA memory snapshot (pickle for pytorch.org/memory_viz) of one fwd+bwd -> ``memory_snapshot``."""

    name = "memory_snapshot"

    def profile(self, job: Job, ctx: RunContext, so_far: Mapping[str, Any]) -> dict[str, Any]:
        if ctx.device.type != "cuda":  # CUDA's allocator history only: no folder for a snapshot never taken
            return {"memory_snapshot": None}
        out_dir = _artifact_dir(ctx, "memory_snapshots", job.path)
        if out_dir is None:
            return {"memory_snapshot": None}
        step = _train_step_fn(job) or (lambda: job.run())
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        try:
            step()
            file = out_dir / "snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(file))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        job.module.zero_grad(set_to_none=True)
        return {"memory_snapshot": str(file)}


PROFILERS: dict[str, type[Profiler]] = {
    "latency_fwd": LatencyForward,
    "latency_fwd_bwd": LatencyForwardBackward,
    "flops": Flops,
    "params": ParamBytes,
    "memory": PeakMemory,
    "bandwidth": BytesMoved,
    "trace": Trace,
    "memory_snapshot": MemorySnapshot,
}
