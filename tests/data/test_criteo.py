from __future__ import annotations

import dataclasses
import random
import re
import sys
import warnings

import pytest
import torch

from loka_trainer.data import DataConfig, SyntheticSource, build_stream, write_criteo_tsv
from loka_trainer.data.criteo_format import is_row, line_pattern, parse_rows, row_text
from loka_trainer.data.schema import sparse_vocab_sizes

from .helpers import assert_batches_equal, row_keys

SYN = DataConfig(batch_size=100, max_vocab_size=20_000)
VOCAB = sparse_vocab_sizes(26, 20_000)


def _criteo_cfg(path, **changes) -> DataConfig:
    return dataclasses.replace(DataConfig(name="criteo", path=str(path), batch_size=50, max_vocab_size=20_000,
                                          eval_batches=2, prefetch=0), **changes)


@pytest.fixture(scope="module")
def synthetic_batches():
    source = SyntheticSource(SYN)
    return [source.batch_at("train", i) for i in range(4)]


@pytest.fixture
def tsv(tmp_path, synthetic_batches):
    path = tmp_path / "train.txt"
    assert write_criteo_tsv(synthetic_batches, str(path), 400) == 400
    return path


def test_write_then_read_round_trips(tsv, synthetic_batches):
    lines = tsv.read_text().splitlines()
    assert len(lines) == 400 and all(len(line.split("\t")) == 40 for line in lines)
    stream = build_stream(_criteo_cfg(tsv, eval_batches=0), split="train", rank=0, world_size=1)
    read = [next(stream) for _ in range(8)]  # 8 x 50 rows = the 4 written batches of 100
    for i, original in enumerate(synthetic_batches):
        a, b = read[2 * i], read[2 * i + 1]
        torch.testing.assert_close(torch.cat([a.dense, b.dense]), original.dense, rtol=0, atol=0)
        assert torch.equal(torch.cat([a.labels, b.labels]), original.labels)
        ids = torch.cat([a.sparse.values().view(26, 50), b.sparse.values().view(26, 50)], 1)
        assert torch.equal(ids, original.sparse.values().view(26, 100))
    assert stream.num_malformed == 0


def test_malformed_lines_are_skipped_counted_and_reported(tmp_path, tsv):
    good = tsv.read_text().splitlines()[:100]
    bad = [
        "\t".join(good[0].split("\t")[:-1]),          # 39 fields
        "2" + good[1][1:],                            # label not 0/1
        good[2].replace("\t", "\tx", 1),              # non-integer count
        good[3][: -8] + "zzzzzzzz",                   # bad hex
        good[4] + "\t00000001",                       # 41 fields
    ]
    lines = good[:10] + bad[:2] + good[10:60] + bad[2:] + good[60:]
    path = tmp_path / "dirty.txt"
    path.write_text("\n".join(lines) + "\n")
    stream = build_stream(_criteo_cfg(path, eval_batches=0), split="train", rank=0, world_size=1)
    with pytest.warns(UserWarning, match="malformed Criteo line 11") as record:
        rows = [next(stream), next(stream)]
        next(stream)  # wraps around: the second pass must not count the bad lines again
    assert stream.num_malformed == 5
    assert any("skipped 5 malformed lines" in str(w.message) for w in record)
    assert torch.equal(torch.cat([r.labels for r in rows]), torch.tensor([float(line[0]) for line in good]))
    assert stream.state_dict()["num_malformed"] == 5


def test_missing_and_negative_fields():
    fields = ["1", "-2", ""] + ["7"] * 11 + ["", "1f"] + ["00000003"] * 24
    labels, counts, ids = parse_rows([row_text("\t".join(fields).encode() + b"\n")], VOCAB)  # newline accepted
    assert labels.tolist() == [1] and counts[0, :3].tolist() == [-2, 0, 7]
    assert ids[0, :2].tolist() == [0, 0x1F % VOCAB[1]]
    assert not is_row(b"1\t+2" + b"\t" * 38)  # only plain integers


def _row_by_python(text: bytes) -> tuple[int, list[int], list[int]]:
    """The Criteo row format read field by field with Python's int(): what ``parse_rows`` must equal."""
    fields = text.split(b"\t")
    counts = [int(f) if f else 0 for f in fields[1:14]]
    return int(fields[0]), counts, [(int(f, 16) if f else 0) % v for f, v in zip(fields[14:], VOCAB)]


def test_parse_rows_equals_reading_each_field_with_python_int():
    gen = torch.Generator().manual_seed(0)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    extremes = ["", "0", "-0", "007", "-1", "9" * 18, "-" + "9" * 18, "123456789012345678"]
    hexes = ["", "0", "f", "A", "00000001", "deadBEEF", "f" * 16, "F" * 16, "8000000000000000", "0123456789abcdef"]
    rows = []
    for _ in range(300):
        counts = [pick(extremes + [str(int(torch.randint(-5, 10**6, (1,), generator=gen)))]) for _ in range(13)]
        cats = [pick(hexes + [f"{int(torch.randint(0, 2**31, (1,), generator=gen)):08x}"]) for _ in range(26)]
        rows.append("\t".join([pick(["0", "1"]), *counts, *cats]).encode())
    assert all(is_row(row) for row in rows)
    labels, counts, ids = parse_rows(rows, VOCAB)
    expected = [_row_by_python(row) for row in rows]
    assert labels.tolist() == [e[0] for e in expected]
    assert counts.tolist() == [e[1] for e in expected]
    assert ids.tolist() == [e[2] for e in expected]


def _row_by_fields(text: bytes) -> bool:
    """Whether ``text`` is a Criteo row, field by field: label 0/1, 13 counts of an optional minus and 1-18 digits
    (or empty), 26 hex values of 0-16 digits. ``is_row``'s one whole-line pattern must say the same."""
    fields = text.split(b"\t")
    return (len(fields) == 40 and fields[0] in (b"0", b"1")
            and all(f == b"" or (len(digits := f.removeprefix(b"-")) in range(1, 19) and digits.isdigit())
                    for f in fields[1:14])
            and all(len(f) <= 16 and all(c in b"0123456789abcdefABCDEF" for c in f) for f in fields[14:]))


def test_is_row_and_both_line_patterns_agree_with_a_field_by_field_check_on_damaged_rows():
    kinds = (False, True) if sys.version_info >= (3, 11) else (False,)  # 3.10's re has no possessive quantifiers
    patterns = [re.compile(line_pattern(possessive=p)) for p in kinds]
    rng = random.Random(0)
    rows = [b"\t".join([b"1", *[b"12"] * 13, *[b"0000abcd"] * 26]), b"\t".join([b"0", *[b""] * 39])]
    edits = [b"", b"-", b"-0", b"--1", b"1-", b"+1", b"9" * 18, b"9" * 19, b"-" + b"9" * 18, b"-" + b"9" * 19,
             b"f" * 16, b"f" * 17, b"F0", b"0x1", b"g", b"2", b"1.5", b" 1", b"\t", b"\t\t"]
    seen = {True: 0, False: 0}
    for _ in range(20_000):
        fields = rng.choice(rows).split(b"\t")
        for _ in range(rng.randint(1, 3)):
            fields[rng.randrange(len(fields))] = rng.choice(edits)
        text = b"\t".join(fields)
        expected = _row_by_fields(text)
        assert is_row(text) == expected, text
        assert all((pattern.fullmatch(text) is not None) == expected for pattern in patterns)
        seen[is_row(text)] += 1
    assert min(seen.values()) > 1000  # both outcomes exercised


@pytest.mark.parametrize("line_end", [b"\r\n", b"  \n", b" \r\n"])
def test_a_utf8_byte_order_mark_crlf_and_trailing_spaces_leave_every_row_readable(tmp_path, tsv, line_end):
    path = tmp_path / "exported.txt"
    path.write_bytes(b"\xef\xbb\xbf" + tsv.read_bytes().replace(b"\n", line_end))
    cfg = _criteo_cfg(path, batch_size=400, eval_batches=0)
    exported = next(build_stream(cfg, split="train", rank=0, world_size=1))
    assert_batches_equal(exported, next(build_stream(_criteo_cfg(tsv, batch_size=400, eval_batches=0),
                                                     split="train", rank=0, world_size=1)))


@pytest.mark.parametrize("world_size", [1, 3])
def test_ranks_get_disjoint_contiguous_shards_covering_the_file(tsv, world_size):
    cfg = _criteo_cfg(tsv, batch_size=1, eval_batches=0)
    seen = []
    for rank in range(world_size):
        stream = build_stream(cfg, split="train", rank=rank, world_size=world_size)
        rows = set()
        while stream.epoch == 0:
            rows |= row_keys(next(stream))
        seen.append(rows)
    assert sum(len(r) for r in seen) == len(set().union(*seen)) == 400


def test_eval_tail_is_disjoint_from_train_and_restartable(tsv):
    cfg = _criteo_cfg(tsv, eval_fraction=0.25, batch_size=1, eval_batches=1000)
    train = build_stream(cfg, split="train", rank=0, world_size=1)
    train_rows = set()
    while train.epoch == 0:
        train_rows |= row_keys(next(train))
    evals = build_stream(cfg, split="eval", rank=0, world_size=1)
    first, second = list(evals), list(evals)
    eval_rows = set().union(*(row_keys(b) for b in first))
    assert len(train_rows) + len(eval_rows) == 400 and not train_rows & eval_rows
    assert 60 < len(eval_rows) < 140  # ~25% of the bytes, line-aligned
    for a, b in zip(first, second, strict=True):
        assert_batches_equal(a, b)
    capped = build_stream(dataclasses.replace(cfg, batch_size=7, eval_batches=3), split="eval", rank=0, world_size=1)
    assert len(list(capped)) == 3


def _resume_after(cfg: DataConfig, batches: int):
    """(stream after `batches` batches and one more, a stream resumed from its state before that one, that batch)."""
    stream = build_stream(cfg, split="train", rank=0, world_size=1)
    for _ in range(batches):
        next(stream)
    state = stream.state_dict()
    expected = next(stream)
    resumed = build_stream(cfg, split="train", rank=0, world_size=1)
    resumed.load_state_dict(state)
    return stream, resumed, expected


def test_resume_mid_file(tsv):
    _, resumed, expected = _resume_after(_criteo_cfg(tsv, batch_size=30, eval_batches=0), 15)  # past 400 rows
    assert_batches_equal(next(resumed), expected)
    assert resumed.epoch == 1


@pytest.mark.parametrize("tail", ["", "1\tbad\n"])
def test_resume_at_the_end_of_an_epoch_wraps_around(tmp_path, tsv, tail):
    """400 rows in batches of 40: the position after 10 batches is the end of the range (or only a malformed
    line before it)."""
    path = tmp_path / "tail.txt"
    path.write_text(tsv.read_text() + tail)
    cfg = _criteo_cfg(path, batch_size=40, eval_batches=0, prefetch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream, resumed, expected = _resume_after(cfg, 10)
        assert_batches_equal(next(resumed), expected)
    stream.close()
    resumed.close()

@pytest.mark.parametrize("changes", [dict(eval_fraction=0.5), dict(eval_batches=0)])
def test_resume_into_another_byte_range_is_refused(tsv, changes):
    """A position saved with the tail held out must not resume where that tail (or another rank's rows) is train."""
    cfg = _criteo_cfg(tsv, batch_size=30, eval_fraction=0.1)
    stream = build_stream(cfg, split="train", rank=0, world_size=1)
    for _ in range(10):
        next(stream)
    resumed = build_stream(dataclasses.replace(cfg, **changes), split="train", rank=0, world_size=1)
    with pytest.raises(ValueError, match="byte_range="):
        resumed.load_state_dict(stream.state_dict())

@pytest.mark.parametrize("changes, named", [(dict(eval_fraction=0.5), "byte_range="),
                                            (dict(batch_size=20), "batch_size=30")])
def test_a_resume_decision_tells_another_data_position_without_building_the_stream(tsv, changes, named):
    """What the stream's load refuses, `launch.data_position_mismatch` says from the config alone (the early resume
    check, before anything is written); a file it cannot read is left to the stream's own load."""
    from loka_trainer.data.stream import stream_identity
    from loka_trainer.launch import data_position_mismatch

    cfg = _criteo_cfg(tsv, batch_size=30, eval_fraction=0.1)
    stream = build_stream(cfg, split="train", rank=1, world_size=2)
    next(stream)
    state = stream.state_dict()
    assert stream_identity(cfg, split="train", rank=1, world_size=2).items() <= state.items()
    assert data_position_mismatch(cfg, state, rank=1, world_size=2) is None
    other = dataclasses.replace(cfg, **changes)
    assert named in data_position_mismatch(other, state, rank=1, world_size=2)
    with pytest.raises(ValueError, match=named):
        build_stream(other, split="train", rank=1, world_size=2).load_state_dict(state)
    assert data_position_mismatch(_criteo_cfg(tsv.parent / "gone.txt"), state, rank=1, world_size=2) is None
    stream.close()


def test_file_without_valid_rows_raises(tmp_path):
    path = tmp_path / "junk.txt"
    path.write_text("not\ta\tcriteo\tline\n" * 3)
    stream = build_stream(_criteo_cfg(path, eval_batches=0), split="train", rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="has no valid Criteo rows"):
            next(stream)
    assert stream.num_malformed == 3


def test_writer_refuses_what_criteo_cannot_hold(tmp_path):
    multi = SyntheticSource(dataclasses.replace(SYN, multi_hot=2)).batch_at("train", 0)
    with pytest.raises(ValueError, match="multi_hot=1"):
        write_criteo_tsv([multi], str(tmp_path / "x.txt"), 10)
    seq = SyntheticSource(dataclasses.replace(SYN, num_sequences=1, max_sequence_length=4)).batch_at("train", 0)
    with pytest.warns(UserWarning, match="sequences are dropped"):
        assert write_criteo_tsv([seq], str(tmp_path / "y.txt"), 10) == 10
    scaled = dataclasses.replace(seq, dense=seq.dense * 0.5, sequences=None)
    with pytest.raises(ValueError, match="log1p of non-negative integer counts"):
        write_criteo_tsv([scaled], str(tmp_path / "z.txt"), 10)


def test_shard_check_names_the_rank_whose_eval_share_is_under_a_batch(tsv):
    from loka_trainer.data.criteo import check_shards

    cfg = _criteo_cfg(tsv, eval_fraction=0.25)  # 400 rows: about 100 eval rows, 50 per rank of 2
    check_shards(dataclasses.replace(cfg, batch_size=40), world_size=2)  # about 50 each: a batch of 40 fits
    with pytest.raises(ValueError, match=r"holds \d+ valid rows in rank [01]'s share \(of 2\).*data.batch_size=60"):
        check_shards(dataclasses.replace(cfg, batch_size=60), world_size=2)
    check_shards(dataclasses.replace(cfg, batch_size=60, eval_batches=0), world_size=2)  # no eval: no check
    with pytest.raises(ValueError, match="fewer than one batch of data.batch_size=60") as refused:
        check_shards(dataclasses.replace(cfg, batch_size=60, eval_path=str(tsv), eval_fraction=0.0), world_size=8)
    assert "use a larger data.eval_path" in str(refused.value) and "eval_fraction" not in str(refused.value)


@pytest.mark.parametrize("edit, reason", [
    (lambda line: "1.0" + line[1:], "label is b'1.0', not 0 or 1"),                      # labels written as floats
    (lambda line: line.split("\t", 1)[1], "39 tab-separated fields, not 40"),            # Criteo's unlabelled test.txt
    (lambda line: line.replace("\t", "\t2.5", 1), "I1 is b'2.5"),
])
def test_a_file_without_valid_rows_is_refused_saying_why_its_lines_do_not_parse(tmp_path, tsv, edit, reason):
    from loka_trainer.data.criteo import check_shards

    path = tmp_path / "converted.txt"
    path.write_text("".join(edit(line) for line in tsv.read_text().splitlines(keepends=True)))
    with pytest.raises(ValueError, match="has no valid Criteo row") as info:
        check_shards(_criteo_cfg(path), world_size=1)
    assert f"(its first malformed line: {reason}" in str(info.value)
    lines = tsv.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5] + [edit(lines[5])] + lines[6:]))
    stream = build_stream(_criteo_cfg(path, eval_batches=0), split="train", rank=0, world_size=1)
    with pytest.warns(UserWarning, match=re.escape(f"skipping malformed Criteo line 6 ({reason}")):
        next(stream)

@pytest.mark.parametrize("compress, name", [("gzip", "gzip"), ("bz2", "bzip2"), ("lzma", "xz")])
def test_a_compressed_file_is_refused_naming_its_format(tsv, tmp_path, compress, name):
    import importlib

    from loka_trainer.data.criteo import check_shards

    packed = tmp_path / f"train.{compress}"
    packed.write_bytes(importlib.import_module(compress).compress(tsv.read_bytes()))
    with pytest.raises(ValueError, match=rf"data.path '{packed}' is {name}-compressed: .* decompress it first"):
        check_shards(_criteo_cfg(packed), world_size=1)
    with pytest.raises(ValueError, match=rf"data.eval_path '{packed}' is {name}-compressed"):
        check_shards(dataclasses.replace(_criteo_cfg(tsv), eval_path=str(packed)), world_size=1)
    check_shards(_criteo_cfg(tsv, eval_batches=0), world_size=1)  # the plain file passes
