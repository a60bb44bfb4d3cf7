from __future__ import annotations

import json

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


def test_json_round_trip_keeps_errors_and_notes(tmp_path):
    original = _result()
    original.nodes["model"].status, original.nodes["model"].error = "estimated", "ValueError: called twice"
    original.nodes["model"].notes = ["estimated from children: latency_fwd_ms"]
    original.nodes["model.a"].notes = ["LoKA Dispatch: 1 of 3 GEMMs in FP8", "no output requires grad; fwd+bwd n/a"]
    back = read_json(write_json(original, tmp_path / "r.json"))
    assert back.nodes["model"].error == "ValueError: called twice"
    assert back.nodes["model.a"].notes == original.nodes["model.a"].notes
    assert rows(back) == rows(original)


def test_json_without_note_lists_keeps_its_notes_column(tmp_path):
    path = write_json(_result(), tmp_path / "r.json")
    data = json.loads(path.read_text())
    for node in data["nodes"]:
        node.pop("note_list", None), node.pop("error", None)  # as written before these fields existed
    data["nodes"][1]["notes"] = "batch replication unsupported for Batch input"
    path.write_text(json.dumps(data))
    assert rows(read_json(path))[1]["notes"] == "batch replication unsupported for Batch input"
