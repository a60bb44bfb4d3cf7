"""Built-in result plugins: table (CSV, JSON, Markdown), offline icicle HTML, TensorBoard scalars + table."""
from __future__ import annotations

from pathlib import Path

from loka_trainer.bench.icicle import write_icicle
from loka_trainer.bench.plugins import ResultPlugin
from loka_trainer.bench.table import NUMERIC_COLUMNS, markdown_table, rows, write_csv, write_json, write_markdown
from loka_trainer.bench.tree import BenchResult


class _Named(ResultPlugin):
    def __init__(self, stem: str = "bench", title: str = "Component Benchmark", color_by: str = "auto") -> None:
        self.stem, self.title, self.color_by = stem, title, color_by


class CsvTable(_Named):
    name = "csv"

    def write(self, result: BenchResult, out_dir: Path) -> list[Path]:
        return [write_csv(result, out_dir / f"{self.stem}.csv")]


class JsonTable(_Named):
    name = "json"

    def write(self, result: BenchResult, out_dir: Path) -> list[Path]:
        return [write_json(result, out_dir / f"{self.stem}.json")]


class MarkdownTable(_Named):
    name = "markdown"

    def write(self, result: BenchResult, out_dir: Path) -> list[Path]:
        return [write_markdown(result, out_dir / f"{self.stem}.md", title=self.title)]


class Icicle(_Named):
    name = "icicle"

    def write(self, result: BenchResult, out_dir: Path) -> list[Path]:
        return [write_icicle(result, out_dir / f"{self.stem}_icicle.html", color_by=self.color_by, title=self.title)]


class TensorBoard(_Named):
    """Per-module scalars (tag ``<column>/<path>``) and the Markdown table as text, under ``out_dir/tensorboard``."""

    name = "tensorboard"

    def write(self, result: BenchResult, out_dir: Path) -> list[Path]:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 -- optional result

        log_dir = out_dir / "tensorboard"
        with SummaryWriter(str(log_dir)) as writer:
            for r in rows(result):
                for col, _, _ in NUMERIC_COLUMNS:
                    if r[col] is not None:
                        writer.add_scalar(f"{col}/{r['component_name']}", r[col], 0)
            writer.add_text("table", markdown_table(result, title=self.title))
        return [log_dir]


RESULTS: dict[str, type[ResultPlugin]] = {
    "csv": CsvTable,
    "json": JsonTable,
    "markdown": MarkdownTable,
    "icicle": Icicle,
    "tensorboard": TensorBoard,
}
