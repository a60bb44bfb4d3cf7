"""Result table (paper IV-A1 columns) as rows, and its CSV / JSON / Markdown writers. n/a is never a number."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Optional

from loka_trainer.bench.tree import BenchResult, Node

# (column, metric key, scale) -- scale converts the stored unit to the column's unit.
NUMERIC_COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("latency_fwd_ms", "latency_fwd_ms", 1.0),
    ("latency_fwd_bwd_ms", "latency_fwd_bwd_ms", 1.0),
    ("model_size_mb", "param_bytes", 1e-6),
    ("gflops_fwd", "flops_fwd", 1e-9),
    ("gflops_fwd_bwd", "flops_fwd_bwd", 1e-9),
    ("tflops_per_s", "tflops", 1.0),
    ("mfu_pct", "mfu_pct", 1.0),
    ("peak_tflops", "peak_tflops", 1.0),
    ("cpu_time_total_ms", "cpu_time_total_ms", 1.0),
    ("gpu_time_total_ms", "gpu_time_total_ms", 1.0),
    ("est_bytes_moved_mb", "bytes_moved", 1e-6),
    ("est_bw_gbps", "bw_gbps", 1.0),
    ("bw_util_pct", "bw_util_pct", 1.0),
    ("peak_bw_gbps", "peak_bw_gbps", 1.0),
    ("peak_mem_mb", "peak_mem_bytes", 1e-6),
)
TEXT_COLUMNS = ("trace", "memory_snapshot")


def row(node: Node) -> dict[str, Any]:
    """One table row; numeric cells are floats or None (n/a)."""
    out: dict[str, Any] = {"component_name": node.path, "type": node.type_name, "depth": node.depth,
                           "status": node.status, "judged_by": node.judged_by}
    for col, key, scale in NUMERIC_COLUMNS:
        v = node.metrics.get(key)
        out[col] = None if v is None else float(v) * scale
    for key in TEXT_COLUMNS:
        out[key] = node.metrics.get(key)
    out["notes"] = "; ".join(([node.error] if node.error else []) + node.notes)
    return out


def rows(result: BenchResult) -> list[dict[str, Any]]:
    return [row(n) for n in result.bfs()]


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def header(result: BenchResult) -> dict[str, Any]:
    return {"device": result.device, "device_name": result.device_name, "compute_dtype": result.compute_dtype,
            "peak": result.peak_name or "unknown (MFU n/a)"}


def write_csv(result: BenchResult, path: Path) -> Path:
    table = rows(result)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows({k: fmt(v, 6) for k, v in r.items()} for r in table)
    return path


def write_json(result: BenchResult, path: Path) -> Path:
    # error and note_list keep a node's own fields (the notes column joins them), so read_json restores both
    nodes = [dict(row(n), parent=n.parent, children=n.children, metrics=n.metrics, error=n.error, note_list=n.notes)
             for n in result.bfs()]
    path.write_text(json.dumps({"header": header(result), "nodes": nodes}, indent=1, default=str))
    return path


def _mfu_cell(r: dict[str, Any], dtype: str) -> str:
    if r["mfu_pct"] is None:
        return "n/a"
    return f"{r['mfu_pct']:.3g}% of {r['peak_tflops']:.0f} {dtype}"


def markdown_table(result: BenchResult, *, title: Optional[str] = None) -> str:
    """The result as a Markdown document: a title, the device line and one table row per module."""
    cols = ["component_name", "type", "status", "latency_fwd_ms", "latency_fwd_bwd_ms", "model_size_mb",
            "tflops_per_s", "MFU (peak TFLOP/s)", "est_bw_gbps", "bw_util_pct", "peak_mem_mb"]
    h = header(result)
    lines = [f"# {title or 'Component Benchmark'}", "",
             f"device: {h['device_name']} ({h['device']}), compute dtype {h['compute_dtype']}, peak: {h['peak']}",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows(result):
        cells = [r["component_name"], r["type"], r["status"]] + [fmt(r[c]) for c in cols[3:7]]
        cells += [_mfu_cell(r, h["compute_dtype"])] + [fmt(r[c]) for c in cols[8:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(result: BenchResult, path: Path, *, title: Optional[str] = None) -> Path:
    path.write_text(markdown_table(result, title=title))
    return path


def read_json(path: Path) -> BenchResult:
    """The BenchResult that `write_json` wrote, e.g. to redraw a GPU run's icicle on another machine: errors and
    notes included (a file without ``note_list`` keeps its notes column as one note)."""
    data = json.loads(Path(path).read_text())
    h = data["header"]
    nodes = {}
    for r in data["nodes"]:
        notes = r["note_list"] if "note_list" in r else [r["notes"]] if r.get("notes") else []
        nodes[r["component_name"]] = Node(path=r["component_name"], type_name=r["type"], depth=r["depth"],
                                          parent=r["parent"], children=list(r["children"]), status=r["status"],
                                          error=r.get("error", ""), notes=list(notes), metrics=dict(r["metrics"]),
                                          judged_by=r["judged_by"])
    peak = None if h["peak"].startswith("unknown") else h["peak"]
    root = data["nodes"][0]["component_name"]
    return BenchResult(nodes=nodes, root=root, device=h["device"], device_name=h["device_name"],
                       compute_dtype=h["compute_dtype"], peak_name=peak)
