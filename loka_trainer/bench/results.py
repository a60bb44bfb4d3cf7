"""Built-in result plugins: table (CSV, JSON, Markdown), offline icicle HTML, TensorBoard scalars + table."""
from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

from loka_trainer.bench.icicle import write_icicle
from loka_trainer.bench.plugins import ResultPlugin
from loka_trainer.bench.table import NUMERIC_COLUMNS, markdown_table, rows, write_csv, write_json, write_markdown
from loka_trainer.bench.tree import BenchResult

# What a run writes into its run dir: the run config, the profilers' folders, TensorBoard's and the result files
# (``bench_<name>`` from the command line, ``bench`` from `write_results`, + the suffix of each table / icicle writer).
BENCH_DIRS = (".hydra", "traces", "memory_snapshots", "tensorboard")
BENCH_FILES = ("bench.csv", "bench.json", "bench.md", "bench_icicle.html",
               "bench_*.csv", "bench_*.json", "bench_*.md", "bench_*_icicle.html")


def earlier_outputs(run_dir: Path, *, dirs: Sequence[str] = BENCH_DIRS,
                    files: Sequence[str] = BENCH_FILES) -> list[Path]:
    """The outputs an earlier benchmark run left in ``run_dir``: the folders named ``dirs`` and the files matching
    the globs ``files`` (sorted by name)."""
    found = [run_dir / name for name in dirs if (run_dir / name).exists()]
    return found + sorted({p for g in files for p in run_dir.glob(g) if p.is_file()})


def stderr_line(line: str) -> None:
    """``line`` on stderr (where the command line's notes go: stdout lists the files written)."""
    print(line, file=sys.stderr)


def _names(paths: Sequence[Path]) -> str:
    return ", ".join(p.name for p in paths)


def restore_earlier_run(run_dir: Path, dest: Path) -> list[str]:
    """After a run into ``run_dir`` failed: the outputs set aside in ``dest`` move back into ``run_dir``; whatever
    the failed run had written of its own (`earlier_outputs`) moves to a new ``previous/`` folder first (nothing is
    deleted). ``dest`` is removed, and ``previous/`` too when that leaves it empty. Returns the lines to log ([] when
    the failed run had written nothing)."""
    from loka_trainer.resume import move_to_previous  # noqa: PLC0415 -- the checkpoint stack, for this only

    lines = []
    if partial := earlier_outputs(run_dir):
        aside = move_to_previous(run_dir, partial)
        lines.append(f"the failed run's outputs ({_names(partial)}) were moved to {aside}")
    for path in sorted(dest.iterdir()):
        shutil.move(str(path), str(run_dir / path.name))
    dest.rmdir()
    if not any(dest.parent.iterdir()):
        dest.parent.rmdir()
    return lines


@contextlib.contextmanager
def earlier_run_set_aside(run_dir: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Around a run that writes into ``run_dir``: an earlier run's outputs (`earlier_outputs`) wait in
    ``<run_dir>/previous/<date>_<time>/``, as the trainer's run dir does, so two runs' traces and TensorBoard events
    never mix, and stay there once the run returns (``log`` gets the line saying where). When the run raises, they
    move back (`restore_earlier_run`): a failed rerun leaves the earlier results where they were. Nothing is
    deleted, and nothing is moved or logged when ``run_dir`` holds no earlier outputs."""
    from loka_trainer.resume import move_to_previous  # noqa: PLC0415 -- the checkpoint stack, for this only

    outputs = earlier_outputs(run_dir)
    if not outputs:
        yield
        return
    dest = move_to_previous(run_dir, outputs)
    try:
        yield
    except BaseException:
        for line in restore_earlier_run(run_dir, dest):
            log(line)
        raise
    log(f"the earlier run's outputs ({_names(outputs)}) were moved to {dest}")


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
