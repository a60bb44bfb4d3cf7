from __future__ import annotations

from loka_trainer.bench.table import read_json, rows, write_json
from loka_trainer.bench.tree import BenchResult, Node


def _result() -> BenchResult:
    root = Node(path="model", type_name="M", depth=0, parent=None, children=["model.a"],
                metrics={"latency_fwd_ms": 2.0, "gflops_fwd": 1.0})
    leaf = Node(path="model.a", type_name="Linear", depth=1, parent="model", status="estimated",
                metrics={"latency_fwd_ms": 1.5}, judged_by="bandwidth")
    return BenchResult(nodes={"model": root, "model.a": leaf}, root="model", device="cuda:0",
                       device_name="NVIDIA H200", compute_dtype="bf16", peak_name="H200 SXM")


def test_json_round_trip_keeps_tree_metrics_and_peak(tmp_path):
    original = _result()
    back = read_json(write_json(original, tmp_path / "r.json"))
    assert list(back.nodes) == ["model", "model.a"] and back.nodes["model"].children == ["model.a"]
    assert back.nodes["model.a"].status == "estimated" and back.nodes["model.a"].judged_by == "bandwidth"
    assert back.peak_name == "H200 SXM" and back.device_name == "NVIDIA H200"
    assert rows(back) == rows(original)
