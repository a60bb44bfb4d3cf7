"""Criteo TSV reader (a ``BatchStream``) and writer (dumps any Criteo-shaped batches, e.g. the synthetic stream).

Distribution over ranks: **contiguous byte shards**. A byte range is split into ``world_size`` equal parts and a
rank owns the lines that *start* inside its part, so every line belongs to exactly one rank and each rank reads
only its own bytes (Terabyte day files are ~45 GB). Split: with ``eval_path`` unset, the first
``1 - eval_fraction`` of ``path`` (by bytes, line-aligned) is train and the tail is eval.

Malformed lines (wrong field count, non-integer count, label not 0/1, bad hex) are skipped and counted once
(the first time they are read) in ``stream.num_malformed``; a warning names the first one, a second warning
gives the total when the first pass over the shard ends.
"""
from __future__ import annotations

import os
import warnings
from typing import Iterable, Optional

import torch
from tqdm import tqdm

from loka_trainer.data.base import BatchStream, check_identity
from loka_trainer.data.batch import Batch
from loka_trainer.data.config import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, DataConfig
from loka_trainer.data.criteo_format import format_lines, is_row, malformed_reason, row_text, rows_to_batch
from loka_trainer.data.schema import counts_from_dense, dense_from_counts, sparse_vocab_sizes


def line_start_at_or_after(path: str, byte: int) -> int:
    """Offset of the first line that starts at or after ``byte`` (file size if none)."""
    if byte <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(byte - 1)
        f.readline()  # finishes the line holding byte-1; if that byte is '\n' this reads just it
        return f.tell()


def shard_range(path: str, lo: int, hi: int, rank: int, world_size: int) -> tuple[int, int]:
    """Line-aligned [start, end) of ``rank``'s contiguous share of the byte range [lo, hi)."""
    span = hi - lo
    start = line_start_at_or_after(path, lo + span * rank // world_size)
    end = line_start_at_or_after(path, lo + span * (rank + 1) // world_size)
    return start, max(start, end)


class CriteoStream(BatchStream):
    """Batches of ``batch_size`` parsed rows from the byte range [start, end) of ``path``.

    ``cycle=True`` (train): wraps around at the end, batches may straddle epochs, never ends.
    ``cycle=False`` (eval): at most ``max_batches`` full batches, restarts on ``iter()``; a partial last batch is
    dropped so every batch has the same shape.
    """

    def __init__(self, path: str, *, start: int, end: int, batch_size: int, cycle: bool,
                 max_batches: Optional[int], identity: dict) -> None:
        self.path, self.start, self.end = path, start, end
        self.batch_size, self.cycle = batch_size, cycle
        self.num_batches = None if cycle else max_batches
        self._identity = dict(identity)
        self._vocab = sparse_vocab_sizes(CRITEO_NUM_SPARSE, identity["max_vocab_size"])
        self._file = None
        self._reset_position()
        self._malformed = 0
        self._first_malformed: Optional[int] = None
        self._high_water = start  # lines ending at or before this byte were checked: don't count them twice
        self._summarized = False
        # Good rows since the pass began, and whether it began at ``start``: only a whole pass without one shows
        # that the range has none (a stream resumed at the end of its range has read nothing yet).
        self._good_in_pass, self._whole_pass = 0, True

    def _reset_position(self) -> None:
        self.offset, self.line, self.epoch, self.batches = self.start, 0, 0, 0
        self._seek_needed = True

    @property
    def num_malformed(self) -> int:
        return self._malformed

    def __iter__(self) -> "CriteoStream":
        if not self.cycle:
            self._reset_position()
        return self

    def __next__(self) -> Batch:
        return rows_to_batch(self._next_rows(), self._vocab)

    def skip(self) -> None:
        """Pass over the next batch's lines without parsing them (under a third of the time of making it): how each
        of several data workers reaches the batches it makes (``StridedWorkerStream``)."""
        self._next_rows()

    def _next_rows(self) -> list[bytes]:
        """The next batch's ``batch_size`` valid rows (``row_text``); StopIteration at the end of an eval range."""
        if self.num_batches is not None and self.batches >= self.num_batches:
            raise StopIteration
        rows = []
        while len(rows) < self.batch_size:
            row = self._next_row()
            if row is None:
                raise StopIteration
            rows.append(row)
        self.batches += 1
        return rows

    def _next_row(self) -> Optional[bytes]:
        """The next valid row's text (``row_text``), or None at the end of a non-cycling range."""
        while True:
            line = self._read_line()
            if line is None:
                if not self._end_pass():
                    return None
                continue
            is_new = self.offset > self._high_water
            self._high_water = max(self._high_water, self.offset)
            row = row_text(line)
            if is_row(row):
                self._good_in_pass += 1
                return row
            if is_new:
                self._record_malformed(line)

    def _read_line(self) -> Optional[bytes]:
        if self.offset >= self.end:
            return None
        if self._file is None:
            self._file = open(self.path, "rb")
            self._seek_needed = True
        if self._seek_needed:  # only after a jump: seeking per line would throw away the read buffer
            self._file.seek(self.offset)
            self._seek_needed = False
        line = self._file.readline()
        if not line:
            return None
        self.offset += len(line)
        self.line += 1
        return line

    def _record_malformed(self, line: bytes) -> None:
        self._malformed += 1
        if self._first_malformed is None:
            self._first_malformed = self.line
            warnings.warn(f"data.path {self.path}: skipping malformed Criteo line {self._where(self.line)} "
                          f"({malformed_reason(line)}); further ones are counted in num_malformed", stacklevel=3)

    def _where(self, line: int) -> str:
        return f"{line}" if self.start == 0 else f"{line} of the shard starting at byte {self.start}"

    def _end_pass(self) -> bool:
        """Close one pass over the range; True when reading continues from the start (cycling)."""
        if not self._summarized and self._malformed:
            warnings.warn(f"data.path {self.path}: skipped {self._malformed} malformed lines "
                          f"(first: line {self._where(self._first_malformed)})", stacklevel=4)
        self._summarized = True
        if not self.cycle:
            return False
        if self._good_in_pass == 0 and self._whole_pass:
            raise ValueError(f"data.path {self.path} has no valid Criteo rows in bytes [{self.start}, {self.end})")
        self._good_in_pass, self._whole_pass = 0, True
        self.offset, self.line, self.epoch = self.start, 0, self.epoch + 1
        self._seek_needed = True
        return True

    def state_dict(self) -> dict:
        return {**self._identity, "offset": self.offset, "line": self.line, "epoch": self.epoch,
                "batches": self.batches, "num_malformed": self._malformed,
                "first_malformed_line": self._first_malformed, "high_water": self._high_water,
                "summarized": self._summarized}

    def load_state_dict(self, state: dict) -> None:
        check_identity(self._identity, state)
        self.offset, self.line, self.epoch = int(state["offset"]), int(state["line"]), int(state["epoch"])
        self._seek_needed = True
        self.batches, self._malformed = int(state["batches"]), int(state["num_malformed"])
        self._first_malformed, self._high_water = state["first_malformed_line"], int(state["high_water"])
        self._summarized = bool(state["summarized"])
        self._good_in_pass, self._whole_pass = 0, self.offset == self.start

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:
        self.close()


def build_criteo_stream(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> CriteoStream:
    """``rank``'s stream over ``cfg.path`` (train) or ``cfg.eval_path`` / the held-out tail of ``cfg.path``."""
    identity = criteo_identity(cfg, split=split, rank=rank, world_size=world_size)
    start, end = identity["byte_range"]
    return CriteoStream(identity["path"], start=start, end=end, batch_size=cfg.batch_size, cycle=split == "train",
                        max_batches=cfg.eval_batches, identity=identity)


def criteo_identity(cfg: DataConfig, *, split: str, rank: int, world_size: int) -> dict:
    """What a saved position of ``rank``'s Criteo stream must match: the file, split, rank layout, settings and the
    rank's line-aligned byte range (reads the file's size and a line or two; no rows are parsed)."""
    path, lo, hi = _split_range(cfg, split)
    start, end = shard_range(path, lo, hi, rank, world_size)
    # The byte range, not just the path: data.eval_fraction, data.eval_path, data.eval_batches=0 and a file that
    # grew all move it, and a saved offset outside it would train on eval rows or on another rank's.
    return {"source": "criteo", "path": os.path.abspath(path), "split": split, "rank": rank,
            "world_size": world_size, "batch_size": cfg.batch_size, "max_vocab_size": cfg.max_vocab_size,
            "byte_range": [start, end]}


def count_rows(path: str, start: int, end: int, *, limit: int) -> tuple[int, Optional[bytes]]:
    """How many valid Criteo rows start in bytes [start, end) of ``path``, counting no further than ``limit``, and
    the first malformed line met (None if none)."""
    found, first_bad = 0, None
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        while found < limit and offset < end:
            line = f.readline()
            if not line:
                break
            offset += len(line)
            good = is_row(row_text(line))
            found += good
            first_bad = line if first_bad is None and not good else first_bad
    return found, first_bad


def check_shards(cfg: DataConfig, *, world_size: int) -> None:
    """Every rank's train shard holds a valid row and, when evaluating, its eval shard a full batch.

    Reads at most ``batch_size`` valid rows per rank and shard (plus the malformed ones among them), so it is
    cheap even on a Terabyte day file. Raises a one-line ``ValueError`` naming the sizes otherwise (a partial
    eval batch is dropped, so an eval shard smaller than one batch yields nothing to evaluate).
    """
    for field, path in (("data.path", cfg.path), ("data.eval_path", cfg.eval_path)):
        if path is not None and _compressed_as(path):
            raise ValueError(f"{field} {path!r} is {_compressed_as(path)}-compressed: ranks read byte ranges of plain "
                             f"TSV, so decompress it first")
    splits = {"train": 1, "eval": cfg.batch_size} if cfg.eval_batches > 0 else {"train": 1}
    for split, need in splits.items():
        path, lo, hi = _split_range(cfg, split)
        for rank in range(world_size):
            start, end = shard_range(path, lo, hi, rank, world_size)
            rows, first_bad = count_rows(path, start, end, limit=need)
            if rows >= need:
                continue
            where = _describe_range(cfg, split, path, lo, hi)
            share = f"rank {rank}'s share (of {world_size})" if world_size > 1 else "it"
            why = "" if first_bad is None else f" (its first malformed line: {malformed_reason(first_bad)})"
            if split == "train":
                raise ValueError(f"data.path {path!r}: {where} has no valid Criteo row in {share} "
                                 f"(bytes [{start}, {end})){why}")
            larger = ("use a larger data.eval_path" if cfg.eval_path is not None
                      else "raise data.eval_fraction, set data.eval_path")
            raise ValueError(f"{where} holds {rows} valid rows in {share} (bytes [{start}, {end})){why}, fewer than "
                             f"one batch of data.batch_size={cfg.batch_size}; lower data.batch_size, {larger}, or "
                             f"skip evaluation with data.eval_batches=0")


COMPRESSED_MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def _compressed_as(path: str) -> Optional[str]:
    """The compression format whose magic bytes start the file (Criteo's downloads are gzip), else None."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((name for magic, name in COMPRESSED_MAGIC.items() if head.startswith(magic)), None)


def _describe_range(cfg: DataConfig, split: str, path: str, lo: int, hi: int) -> str:
    if split == "eval" and cfg.eval_path is None:
        return (f"the eval slice of data.path {path!r} (its last data.eval_fraction={cfg.eval_fraction}: "
                f"{hi - lo} of {hi} bytes)")
    if split == "eval":
        return f"data.eval_path {path!r} ({hi} bytes)"
    return f"the train slice ({hi - lo} bytes)"


def _split_range(cfg: DataConfig, split: str) -> tuple[str, int, int]:
    if cfg.eval_path is not None:
        path = cfg.path if split == "train" else cfg.eval_path
        return path, 0, os.path.getsize(path)
    size = os.path.getsize(cfg.path)
    cut = int(size * (1.0 - cfg.eval_fraction)) if cfg.eval_batches > 0 else size
    return (cfg.path, 0, cut) if split == "train" else (cfg.path, cut, size)


def write_criteo_tsv(stream_or_batches: Iterable[Batch], path: str, num_rows: int, *, progress: bool = False) -> int:
    """Write the first ``num_rows`` rows of ``stream_or_batches`` as Criteo TSV; returns the rows written.

    The batches must be Criteo-shaped: 13 dense features that are ``log1p`` of integer counts (as the synthetic
    source produces), 26 single-id sparse features, labels in {0, 1}. Sequences have no Criteo column and are
    dropped with a warning. The file appears atomically (written to ``path + ".tmp"``, then renamed).
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    written, warned = 0, False
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f, tqdm(total=num_rows, disable=not progress, desc="write criteo tsv", unit="row") as bar:
        for batch in stream_or_batches:
            if written >= num_rows:
                break
            if batch.sequences is not None and not warned:
                warnings.warn("write_criteo_tsv: Criteo TSV has no sequence columns; sequences are dropped")
                warned = True
            lines = format_lines(*_criteo_columns(batch))[: num_rows - written]
            f.writelines(lines)
            written += len(lines)
            bar.update(len(lines))
    os.replace(tmp, path)
    if written < num_rows:
        warnings.warn(f"write_criteo_tsv: the batches ran out after {written} of {num_rows} rows")
    return written


def _criteo_columns(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(labels (B,), counts (B, 13), ids (B, 26)) of a Criteo-shaped batch, or a ValueError saying why not."""
    num_rows, keys = len(batch), batch.sparse.keys()
    if batch.dense.shape[1] != CRITEO_NUM_DENSE or len(keys) != CRITEO_NUM_SPARSE:
        raise ValueError(f"write_criteo_tsv needs {CRITEO_NUM_DENSE} dense and {CRITEO_NUM_SPARSE} sparse features, "
                         f"got {batch.dense.shape[1]} and {len(keys)}")
    if not bool((batch.sparse.lengths() == 1).all()):
        raise ValueError("write_criteo_tsv needs exactly one id per sparse feature and row (data.multi_hot=1)")
    counts = counts_from_dense(batch.dense)
    if not torch.equal(dense_from_counts(counts), batch.dense):
        raise ValueError("write_criteo_tsv needs dense features equal to log1p of non-negative integer counts")
    if not bool(((batch.labels == 0) | (batch.labels == 1)).all()):
        raise ValueError("write_criteo_tsv needs labels in {0, 1}")
    ids = batch.sparse.values().long().view(len(keys), num_rows).t()  # key-major -> (B, 26)
    return batch.labels, counts, ids
