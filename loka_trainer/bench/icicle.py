"""Self-contained offline icicle view (plotly ``go.Icicle`` with plotly.js inlined): box width = latency,
colour = MFU% (compute modules) or bandwidth utilization % (embedding / zero-FLOP modules), hover = all columns.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from loka_trainer.bench.metrics import icicle_values
from loka_trainer.bench.table import NUMERIC_COLUMNS, fmt, header, row
from loka_trainer.bench.tree import BenchResult, Node

NA_COLOR = "#c8c8c8"  # grey: no utilization known (CPU, failed, unknown peak)
COLORSCALE = "RdYlGn"


def color_value(node: Node, color_by: str) -> Optional[float]:
    """The number that colours a node: MFU %, bandwidth utilization %, achieved TFLOP/s, or (auto) the
    utilization the node is judged by."""
    key = {"mfu": "mfu_pct", "bandwidth": "bw_util_pct", "tflops": "tflops"}.get(color_by)
    if key is None:
        key = "bw_util_pct" if node.judged_by == "bandwidth" else "mfu_pct"
    return node.metrics.get(key)


def _colors(values: list[Optional[float]], cmax: float) -> list[str]:
    from plotly.colors import sample_colorscale  # noqa: PLC0415 -- plotly only needed for this result

    return [NA_COLOR if v is None else sample_colorscale(COLORSCALE, [min(max(v / cmax, 0.0), 1.0)])[0]
            for v in values]


def _hover(node: Node) -> str:
    r = row(node)
    lines = [f"<b>{node.path}</b> ({node.type_name})", f"status: {node.status}", f"judged by: {node.judged_by}"]
    lines += [f"{col}: {fmt(r[col])}" for col, _, _ in NUMERIC_COLUMNS]
    if r["notes"]:
        lines.append(f"notes: {r['notes'][:200]}")
    return "<br>".join(lines)


def icicle_figure(result: BenchResult, *, color_by: str = "auto", title: Optional[str] = None) -> Any:
    """A plotly Figure; values are made safe for ``branchvalues="total"`` (see ``icicle_values``)."""
    import plotly.graph_objects as go  # noqa: PLC0415

    nodes = result.bfs()
    index = {n.path: i for i, n in enumerate(nodes)}
    latency = [n.metrics.get("latency_fwd_ms") for n in nodes]
    known = [v for v in latency if v]
    floor = 1e-3 * max(known) if known else 1.0
    values = icicle_values(latency, [[index[c] for c in n.children] for n in nodes], floor)
    if color_by == "auto" and result.peak_name is None:
        color_by = "tflops"  # no stated peak (CPU): utilization is n/a, achieved TFLOP/s still tells hot spots
    util = [color_value(n, color_by) for n in nodes]
    # The best module is green: MFUs of recommendation models sit far below 100%, and a fixed 0-100 scale
    # would paint everything red. The subtitle states what green means.
    cmax = max((u for u in util if u is not None), default=1.0) or 1.0
    if color_by != "tflops":
        # Bytes moved are estimated from input/output sizes, so a no-op (Identity) or a fused view can show
        # more than 100% of peak bandwidth; such an outlier must not wash every other box out to red.
        cmax = min(cmax, 100.0)
    h = header(result)
    fig = go.Figure(go.Icicle(
        ids=[n.path for n in nodes], labels=[n.path.rsplit(".", 1)[-1] for n in nodes],
        parents=[n.parent or "" for n in nodes], values=values, branchvalues="total",
        marker={"colors": _colors(util, cmax), "line": {"width": 1, "color": "white"}},
        hovertext=[_hover(n) for n in nodes], hoverinfo="text", textinfo="label+text",
        text=[f"{fmt(n.metrics.get('latency_fwd_ms'), 3)} ms" for n in nodes],
        tiling={"orientation": "v"}, root={"color": "lightgrey"}))
    peak = h["peak"]
    unit = "TFLOP/s achieved" if color_by == "tflops" else f"{color_by} utilization %"
    subtitle = (f"width = fwd latency; colour = {unit} (red 0 → green {cmax:.3g}); "
                f"grey = n/a | device {h['device_name']}, {h['compute_dtype']}, peak: {peak}")
    fig.update_layout(title={"text": f"{title or 'Component Benchmark'}<br><sup>{subtitle}</sup>"},
                      margin={"t": 80, "l": 10, "r": 10, "b": 10})
    return fig


def write_icicle(result: BenchResult, path: Path, *, color_by: str = "auto", title: Optional[str] = None) -> Path:
    """Write the icicle as one HTML file that works with no network (plotly.js inlined)."""
    fig = icicle_figure(result, color_by=color_by, title=title)
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return path
