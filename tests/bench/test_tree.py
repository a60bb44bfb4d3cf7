from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.bench.examples import MLPTree
from loka_trainer.bench.tree import ModuleInputs, all_paths, build_nodes, capture_inputs, walk


def test_walk_is_breadth_first_with_known_paths():
    paths = [p for p, _, _ in walk(MLPTree(), max_depth=5)]
    assert paths == ["model", "model.left", "model.right", "model.head", "model.left.0", "model.left.1",
                     "model.left.2", "model.right.0", "model.right.1"]


def test_walk_depth_and_exclude():
    assert [p for p, _, _ in walk(MLPTree(), max_depth=1)] == ["model", "model.left", "model.right", "model.head"]
    paths = [p for p, _, _ in walk(MLPTree(), max_depth=5, exclude=["model.left"])]
    assert not any(p.startswith("model.left") for p in paths) and "model.right.0" in paths


def test_shared_module_kept_once():
    lin = nn.Linear(2, 2)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    assert [p for p, _, _ in walk(model, max_depth=2, root_name="m")] == ["m", "m.0", "m.1"]


class TwoTowersOneLayer(nn.Module):
    """Two towers that share (tie) one Linear: ``m.a.0`` and ``m.b.0`` are the same module."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(2, 2)
        self.a, self.b = nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@pytest.mark.parametrize("glob", ["m.0", "m.2"])
def test_excluding_either_path_of_a_shared_module_drops_it(glob):
    lin = nn.Linear(2, 2)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    entries = walk(model, max_depth=2, root_name="m", exclude=[glob])
    assert [p for p, _, _ in entries] == ["m", "m.1"]
    assert lin not in [m for _, m, _ in entries]


@pytest.mark.parametrize("glob", ["m.a", "m.b"])
def test_excluding_a_subtree_drops_its_shared_modules_under_every_path(glob):
    model = TwoTowersOneLayer()
    entries = walk(model, max_depth=3, root_name="m", exclude=[glob])
    assert model.a[0] not in [m for _, m, _ in entries]
    kept = {"m.a": ["m", "m.b"], "m.b": ["m", "m.a", "m.a.1"]}[glob]
    assert [p for p, _, _ in entries] == kept


def test_a_shared_module_is_one_node_selected_by_any_of_its_paths():
    model = TwoTowersOneLayer()
    entries = walk(model, max_depth=3, root_name="m")
    assert [p for p, _, _ in entries] == ["m", "m.a", "m.b", "m.a.0", "m.a.1"]
    nodes = build_nodes(entries, include=["m.b.0"], paths_of=all_paths(model, "m"))
    assert nodes["m.a.0"].status == "ok" and nodes["m.a.1"].status == "estimated"
    assert any("also reachable as m.b.0" in note for note in nodes["m.a.0"].notes)


def test_nodes_parent_children_and_include():
    entries = walk(MLPTree(), max_depth=2)
    nodes = build_nodes(entries, include=["model.left*"])
    assert nodes["model"].children == ["model.left", "model.right", "model.head"]
    assert nodes["model.left.2"].parent == "model.left"
    assert nodes["model.left.0"].status == "ok" and nodes["model.right"].status == "estimated"


def test_capture_inputs_records_real_submodule_inputs():
    model = MLPTree()
    x = torch.randn(4, 16)
    entries = walk(model, max_depth=2)
    captured, out = capture_inputs(model, ModuleInputs((x,), {}), entries)
    torch.testing.assert_close(captured["model.left.0"].args[0], x)
    hidden = torch.relu(model.left[0](x))
    torch.testing.assert_close(captured["model.left.2"].args[0], hidden)
    assert captured["model.head"].args[0].shape == (4, 64)
    torch.testing.assert_close(out, model(x))


def test_containers_do_not_use_up_a_level():
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))
    entries = walk(model, max_depth=1, root_name="m")
    assert [(p, d) for p, _, d in entries] == [("m", 0), ("m.0", 1), ("m.0.0", 1)]
    assert build_nodes(entries, include=())["m.0.0"].parent == "m.0"
