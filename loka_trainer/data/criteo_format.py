"""Criteo Kaggle/Terabyte TSV lines: strict parsing, hashing of categorical hex values, formatting.

A line is ``label \\t I1..I13 \\t C1..C26``: label 0/1, integer counts (may be negative, e.g. I2), categorical
values as hex strings (8 hex digits in the real files). Any count or categorical may be empty (= missing).
Missing counts read as 0; a missing categorical hashes like "0", i.e. to id 0 (torchrec's Criteo convention).
"""
from __future__ import annotations

import re
import sys
from typing import Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.batch import Batch
from loka_trainer.data.config import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from loka_trainer.data.schema import dense_from_counts, sparse_feature_names

def line_pattern(possessive: bool) -> bytes:
    """The whole-line check of a Criteo row (one check instead of per-field try/except: a line that passes converts
    without errors). Counts are limited to 18 digits so they fit int64; hex to 16 digits (64-bit hashes).
    ``possessive`` puts `+` after each quantifier (Python 3.11+): no field holds a tab, so there is nothing to
    backtrack into, the same lines pass, and the check takes ~0.6x the time."""
    p = "+" if possessive else ""
    return (rf"[01]\t(?:-?[0-9]{{1,18}}{p})?{p}(?:\t(?:-?[0-9]{{1,18}}{p})?{p}){{{CRITEO_NUM_DENSE - 1}}}{p}"
            rf"(?:\t[0-9a-fA-F]{{0,16}}{p}){{{CRITEO_NUM_SPARSE}}}{p}").encode()


_LINE_RE = re.compile(line_pattern(possessive=sys.version_info >= (3, 11)))

# Editors and spreadsheet exports start a UTF-8 file with it; it would make the first row's label unreadable.
UTF8_BOM = b"\xef\xbb\xbf"


def row_text(line: bytes) -> bytes:
    """The row of a line: without its line ending (LF or CRLF), trailing spaces (an editor's or export's; no field
    holds a space) and a leading UTF-8 byte order mark."""
    return line.rstrip(b"\r\n ").removeprefix(UTF8_BOM)


def is_row(text: bytes) -> bool:
    """Whether a line's ``row_text`` is a valid Criteo row (``parse_rows`` reads every such row)."""
    return _LINE_RE.fullmatch(text) is not None


# hex digit value per byte; 255 for any other byte (the NUL padding of a fixed-width numpy bytes array)
_HEX_VALUE = np.full(256, 255, dtype=np.uint8)
_HEX_VALUE[list(b"0123456789")] = range(10)
_HEX_VALUE[list(b"abcdef")] = _HEX_VALUE[list(b"ABCDEF")] = range(10, 16)
_NUM_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_SPARSE
_FIELD_BYTES = 19  # a count's "-" and 18 digits; hex values have at most 16


def parse_rows(texts: Sequence[bytes], vocab_sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels (B,) int64 in {0, 1}, counts (B, 13) int64, ids (B, 26) int64) of B valid rows (``is_row``).

    Missing counts read as 0, missing categoricals hash like "0". Hash: ``int(hex, 16) % vocab`` (DLRM's
    preprocessing; the values in Criteo files are already hashes). Vectorized over the batch with numpy: field by
    field in Python a row costs ~30 µs, slower than a GPU-scale step consumes rows. By hand: no dependency of ours
    parses hex TSV columns in C (pandas or pyarrow would, at a 40+ MB install).
    """
    num_rows = len(texts)
    fields = np.array(b"\t".join(texts).split(b"\t"), dtype=f"S{_FIELD_BYTES}").reshape(num_rows, _NUM_FIELDS)
    labels = (fields[:, 0] == b"1").astype(np.int64)
    dense = fields[:, 1:1 + CRITEO_NUM_DENSE]
    counts = np.where(dense == b"", b"0", dense).astype(np.int64)
    hex_bytes = fields[:, 1 + CRITEO_NUM_DENSE:].astype("S16").view(np.uint8).reshape(num_rows, CRITEO_NUM_SPARSE, 16)
    digits = _HEX_VALUE[hex_bytes]  # (B, 26, 16), 255 past a value's last digit
    values = np.zeros((num_rows, CRITEO_NUM_SPARSE), dtype=np.uint64)  # 16 hex digits fit in 64 bits
    for position in range(16):
        digit = digits[:, :, position]
        values = np.where(digit != 255, values * np.uint64(16) + digit.astype(np.uint64), values)
    ids = (values % np.asarray(vocab_sizes, dtype=np.uint64)).astype(np.int64)
    return labels, counts, ids


_FIELD_RULES = (
    (re.compile(rb"[01]"), "0 or 1"),
    (re.compile(rb"(?:-?[0-9]{1,18})?"), "an integer count or empty"),
    (re.compile(rb"[0-9a-fA-F]{0,16}"), "up to 16 hex digits or empty"),
)
_FIELD_NAMES = ("label", *(f"I{i}" for i in range(1, CRITEO_NUM_DENSE + 1)),
                *(f"C{i}" for i in range(1, CRITEO_NUM_SPARSE + 1)))


def malformed_reason(line: bytes) -> str:
    """Why ``is_row`` refuses ``line``'s row, naming the first bad field: 'I3 is b'1.5', not an integer count or
    empty'. For messages only; ``is_row`` decides."""
    fields = row_text(line).split(b"\t")
    if len(fields) != len(_FIELD_NAMES):
        return f"{len(fields)} tab-separated fields, not {len(_FIELD_NAMES)} (label, I1..I13, C1..C26)"
    rules = [_FIELD_RULES[0]] + [_FIELD_RULES[1]] * CRITEO_NUM_DENSE + [_FIELD_RULES[2]] * CRITEO_NUM_SPARSE
    for name, field, (pattern, valid) in zip(_FIELD_NAMES, fields, rules):
        if pattern.fullmatch(field) is None:
            return f"{name} is {field[:24]!r}, not {valid}"
    return "unreadable"


def rows_to_batch(texts: Sequence[bytes], vocab_sizes: Sequence[int]) -> Batch:
    """A ``Batch`` of B valid rows (``parse_rows``): dense (B, 13) = log1p(max(count, 0)), one id per bag, labels
    (B,)."""
    labels, counts, ids = parse_rows(texts, vocab_sizes)
    ids = torch.from_numpy(ids)  # (B, 26)
    sparse = KeyedJaggedTensor(
        keys=list(sparse_feature_names(CRITEO_NUM_SPARSE)),
        values=ids.t().reshape(-1),  # key-major
        lengths=torch.ones(ids.numel(), dtype=torch.int32),
    )
    return Batch(dense=dense_from_counts(torch.from_numpy(counts)), sparse=sparse,
                 labels=torch.from_numpy(labels).to(torch.float32))


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
