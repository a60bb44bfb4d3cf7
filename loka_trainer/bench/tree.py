"""Module tree for the Component Benchmark: input capture with forward hooks and the breadth-first walk.

Paths are ``root_name`` + the module's FQN (``model.dense_arch.0``), so every node, the root included, has a
unique, printable key and its parent is the path without the last component.
"""
from __future__ import annotations

import collections
import dataclasses
import fnmatch
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from loka_trainer.globs import closest_or_examples, unmatched


CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclasses.dataclass
class ModuleInputs:
    """The positional and keyword arguments of one module call (tensors detached; other objects as-is)."""

    args: tuple
    kwargs: dict

    def call(self, module: nn.Module) -> Any:
        return module(*self.args, **self.kwargs)


@dataclasses.dataclass
class Node:
    """One profiled (or estimated) submodule.

    status: "ok" (measured), "failed" (a profiler raised: its columns n/a, the others kept, ``error`` names it;
    nothing left to estimate from children), "estimated" (failed or not selected by the filters, missing
    additive metrics summed from children).
    """

    path: str
    type_name: str
    depth: int
    parent: Optional[str]
    children: list[str] = dataclasses.field(default_factory=list)
    status: str = "ok"
    error: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    judged_by: str = "compute"  # "compute" (MFU) or "bandwidth" (embeddings: MFU n/a)


@dataclasses.dataclass
class BenchResult:
    """All nodes keyed by path (insertion order = breadth-first), plus the run's context."""

    nodes: dict[str, Node]
    root: str
    device: str
    device_name: str
    compute_dtype: str
    peak_name: Optional[str]

    def bfs(self) -> list[Node]:
        return list(self.nodes.values())


def is_leaf(x: Any) -> bool:
    """Pytree leaf test that stops at anything but plain containers, so TorchRec's pytree-registered KJT and
    KeyedTensor (and a Batch) are replayed as the same objects rather than rebuilt from their parts."""
    return not isinstance(x, (tuple, list, dict))


def _detach(x: Any) -> Any:
    # NOTE: clone as well, so an in-place op later in the forward cannot change what we replay.
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _selected(path: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    if any(fnmatch.fnmatchcase(path, p) for p in exclude):
        return False
    return not include or any(fnmatch.fnmatchcase(path, p) for p in include)


def _named(model: nn.Module, root_name: str) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` for every path of every submodule, a shared module once per path."""
    return [(f"{root_name}.{name}" if name else root_name, module)
            for name, module in model.named_modules(remove_duplicate=False)]


def all_paths(model: nn.Module, root_name: str = "model") -> dict[int, list[str]]:
    """``id(module)`` -> every path of that module (``root_name`` + FQN): a module registered at several places
    (a tied / shared layer) has several, in ``named_modules`` order."""
    out: dict[int, list[str]] = {}
    for path, module in _named(model, root_name):
        out.setdefault(id(module), []).append(path)
    return out


def excluded_modules(model: nn.Module, *, root_name: str = "model", exclude: Sequence[str] = ()) -> set[int]:
    """``id``s of the modules ``exclude`` drops: each module with any path matching a glob, and every module under
    it. The exclusion is by module object, so a shared module is dropped under all of its paths."""
    dropped: set[int] = set()
    for path, module in _named(model, root_name):
        if id(module) not in dropped and any(fnmatch.fnmatchcase(path, g) for g in exclude):
            dropped.update(id(m) for m in module.modules())
    return dropped


def walk(model: nn.Module, *, max_depth: int, root_name: str = "model",
         exclude: Sequence[str] = ()) -> list[tuple[str, nn.Module, int]]:
    """Breadth-first ``(path, module, depth)`` to ``max_depth`` (root = depth 0), without `excluded_modules`.

    A module reachable by two paths is one module: kept at its first (shallowest) path only, and dropped when a
    glob of ``exclude`` matches either path. Containers (ModuleList, ModuleDict) take their parent's depth.
    """
    dropped = excluded_modules(model, root_name=root_name, exclude=exclude) if exclude else set()
    seen: set[int] = set()
    out: list[tuple[str, nn.Module, int]] = []
    queue = collections.deque([(root_name, model, 0)])
    while queue:
        path, module, depth = queue.popleft()
        if id(module) in seen or id(module) in dropped:
            continue
        seen.add(id(module))
        out.append((path, module, depth))
        # Containers are never called themselves, so they do not use up a level: their children are shown.
        if isinstance(module, CONTAINERS) or depth < max_depth:
            child_depth = depth if isinstance(module, CONTAINERS) else depth + 1
            queue.extend((f"{path}.{name}", child, child_depth) for name, child in module.named_children())
    return out


def check_globs(option: str, patterns: Sequence[str], paths: Sequence[str], *, scope: str) -> None:
    """A ValueError when a glob of ``patterns`` matches none of ``paths``, naming the closest paths (difflib).

    option: the setting the globs came from (``bench.include``); scope: which paths were searched, for the message.
    """
    typos = unmatched(patterns, paths)
    if typos:
        raise ValueError(f"{option}: {typos} match(es) no submodule {scope}; "
                         + closest_or_examples(typos, paths, "paths"))


def module_paths(model: nn.Module, root_name: str = "model") -> list[str]:
    """Every submodule's path at any depth (``root_name`` + FQN), each path of a shared module included."""
    return [path for paths in all_paths(model, root_name).values() for path in paths]


def build_nodes(entries: list[tuple[str, nn.Module, int]], *, include: Sequence[str],
                paths_of: Optional[Mapping[int, Sequence[str]]] = None) -> dict[str, Node]:
    """Nodes for the walked modules; a node none of whose paths matches ``include`` is kept (for the tree) but
    marked estimated.

    paths_of: `all_paths` of the model; a module with more than one path is matched on all of them and its node
    notes the others (it is one module, measured once). None: each module's walked path only.
    """
    nodes: dict[str, Node] = {}
    for path, module, depth in entries:
        parent = path.rsplit(".", 1)[0] if "." in path else None
        node = Node(path=path, type_name=type(module).__name__, depth=depth, parent=parent)
        others = [p for p in (paths_of or {}).get(id(module), ()) if p != path]
        if not any(_selected(p, include, ()) for p in [path, *others]):
            node.status, node.notes = "estimated", ["not selected by bench.include"]
        if others:
            node.notes.append(f"also reachable as {', '.join(others)} (the same module, measured once)")
        nodes[path] = node
        if parent is not None:
            nodes[parent].children.append(path)
    return nodes


def capture_inputs(model: nn.Module, inputs: ModuleInputs,
                   targets: list[tuple[str, nn.Module, int]]) -> tuple[dict[str, ModuleInputs], Any]:
    """Run the model once and record each target's first-call inputs with forward pre-hooks.

    Returns (path -> inputs, the model's output). A target the forward never calls is absent from the dict.
    """
    captured: dict[str, ModuleInputs] = {}
    handles = []

    def make_hook(path: str):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if path not in captured:
                captured[path] = ModuleInputs(pytree.tree_map(_detach, args, is_leaf=is_leaf),
                                              pytree.tree_map(_detach, kwargs, is_leaf=is_leaf))
        return hook

    for path, module, _ in targets:
        handles.append(module.register_forward_pre_hook(make_hook(path), with_kwargs=True))
    try:
        with torch.no_grad():
            output = inputs.call(model)
    finally:
        for h in handles:
            h.remove()
    return captured, output
