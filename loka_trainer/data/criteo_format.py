"""Criteo Kaggle/Terabyte TSV lines: strict parsing, hashing of categorical hex values, formatting.

A line is ``label \\t I1..I13 \\t C1..C26``: label 0/1, integer counts (may be negative, e.g. I2), categorical
values as hex strings (8 hex digits in the real files). Any count or categorical may be empty (= missing).
Missing counts read as 0; a missing categorical hashes like "0", i.e. to id 0 (torchrec's Criteo convention).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.batch import Batch
from loka_trainer.data.config import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from loka_trainer.data.schema import dense_from_counts, sparse_feature_names

# One whole-line check instead of per-field try/except: a line that passes converts without errors.
# Counts are limited to 18 digits so they fit int64; hex to 16 digits (64-bit hashes).
_LINE_RE = re.compile(
    rb"[01]\t(?:-?[0-9]{1,18})?(?:\t(?:-?[0-9]{1,18})?){%d}(?:\t[0-9a-fA-F]{0,16}){%d}"
    % (CRITEO_NUM_DENSE - 1, CRITEO_NUM_SPARSE)
)

ParsedRow = tuple[int, list[int], list[int]]
# Editors and spreadsheet exports start a UTF-8 file with it; it would make the first row's label unreadable.
UTF8_BOM = b"\xef\xbb\xbf"


def row_text(line: bytes) -> bytes:
    """The row of a line: without its line ending (LF or CRLF), trailing spaces (an editor's or export's; no field
    holds a space) and a leading UTF-8 byte order mark."""
    return line.rstrip(b"\r\n ").removeprefix(UTF8_BOM)


def parse_line(line: bytes, vocab_sizes: Sequence[int]) -> Optional[ParsedRow]:
    """(label, 13 counts, 26 ids hashed into ``vocab_sizes``) or None when the line is malformed (``row_text``
    says what of a line is not part of the row).

    Hash: ``int(hex, 16) % vocab`` (DLRM's preprocessing); the values in Criteo files are already hashes.
    """
    line = row_text(line)
    if _LINE_RE.fullmatch(line) is None:
        return None
    fields = line.split(b"\t")
    counts = [int(f) if f else 0 for f in fields[1:1 + CRITEO_NUM_DENSE]]
    cats = fields[1 + CRITEO_NUM_DENSE:]
    ids = [(int(f, 16) if f else 0) % v for f, v in zip(cats, vocab_sizes)]
    return int(fields[0]), counts, ids


_FIELD_RULES = (
    (re.compile(rb"[01]"), "0 or 1"),
    (re.compile(rb"(?:-?[0-9]{1,18})?"), "an integer count or empty"),
    (re.compile(rb"[0-9a-fA-F]{0,16}"), "up to 16 hex digits or empty"),
)
_FIELD_NAMES = ("label", *(f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1)),
                *(f"C{i}" for i in range(1, CRITEO_NUM_SPARSE + 1)))


def malformed_reason(line: bytes) -> str:
    """Why ``parse_line`` refuses ``line``, naming the first bad field: 'I3 is b'1.5', not an integer count or
    empty'. For messages only; ``parse_line`` decides."""
    fields = row_text(line).split(b"\t")
    if len(fields) != len(_FIELD_NAMES):
        return f"{len(fields)} tab-separated fields, not {len(_FIELD_NAMES)} (label, I1..I13, C1..C26)"
    rules = [_FIELD_RULES[0]] + [_FIELD_RULES[1]] * CRITEO_NUM_DENSE + [_FIELD_RULES[2]] * CRITEO_NUM_SPARSE
    for name, field, (pattern, valid) in zip(_FIELD_NAMES, fields, rules):
        if pattern.fullmatch(field) is None:
            return f"{name} is {field[:24]!r}, not {valid}"
    return "unreadable"


def rows_to_batch(rows: Sequence[ParsedRow]) -> Batch:
    """Stack parsed rows into a ``Batch``: dense (B, 13) = log1p(max(count, 0)), one id per bag, labels (B,)."""
    labels = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    counts = torch.tensor([r[1] for r in rows], dtype=torch.int64)  # (B, 13)
    ids = torch.tensor([r[2] for r in rows], dtype=torch.int64)  # (B, 26)
    sparse = KeyedJaggedTensor(
        keys=list(sparse_feature_names(CRITEO_NUM_SPARSE)),
        values=ids.t().reshape(-1),  # key-major
        lengths=torch.ones(ids.numel(), dtype=torch.int32),
    )
    return Batch(dense=dense_from_counts(counts), sparse=sparse, labels=labels)


def format_lines(labels: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor) -> list[str]:
    """TSV lines (with newline). labels: (B,) {0,1}; counts: (B, 13) int64 >= 0; ids: (B, 26) int64 >= 0.

    Ids are written as 8+ hex digits, so reading them back (``% vocab``) returns the same ids.
    """
    lines = []
    for label, row_counts, row_ids in zip(labels.long().tolist(), counts.tolist(), ids.tolist()):
        dense = "\t".join(map(str, row_counts))
        cats = "\t".join(f"{i:08x}" for i in row_ids)
        lines.append(f"{label}\t{dense}\t{cats}\n")
    return lines
