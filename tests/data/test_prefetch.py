from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from loka_trainer.data import DataConfig, build_stream, write_criteo_tsv
from loka_trainer.data.base import BatchStream, IndexedStream
from loka_trainer.data.prefetch import PrefetchStream
from loka_trainer.data.worker_processes import StridedWorkerStream, WorkerProcessStream

from .helpers import assert_batches_equal

CFG = DataConfig(batch_size=32, max_vocab_size=5_000, num_sequences=1, max_sequence_length=8, prefetch=3)


def _plain(cfg: DataConfig = CFG):
    return build_stream(dataclasses.replace(cfg, prefetch=0), split="train", rank=0, world_size=1)


def test_train_streams_prefetch_and_yield_the_same_batches():
    fast = build_stream(CFG, split="train", rank=0, world_size=1)
    assert isinstance(fast, PrefetchStream)
    assert not isinstance(build_stream(CFG, split="eval", rank=0, world_size=1), PrefetchStream)
    plain = _plain()
    for _ in range(6):
        assert_batches_equal(next(fast), next(plain))
    assert fast.state_dict() == plain.state_dict()  # the position of the consumer, not of the worker
    fast.close()


def test_resume_and_close_never_skip_queued_batches():
    plain = _plain()
    expected = [next(plain) for _ in range(8)]
    fast = build_stream(CFG, split="train", rank=0, world_size=1)
    for i in range(3):
        assert_batches_equal(next(fast), expected[i])
    state = fast.state_dict()
    fast.close()  # the worker had run ahead; closing rewinds it
    assert_batches_equal(next(fast), expected[3])
    resumed = build_stream(CFG, split="train", rank=0, world_size=1)
    resumed.load_state_dict(state)
    assert_batches_equal(next(resumed), expected[3])
    assert_batches_equal(next(resumed), expected[4])
    fast.close()
    resumed.close()


def test_criteo_through_prefetch_counts_malformed(tmp_path):
    path = tmp_path / "train.txt"
    write_criteo_tsv(_plain(DataConfig(batch_size=40)), str(path), 80)
    path.write_text(path.read_text() + "1\tbad\n")
    cfg = DataConfig(name="criteo", path=str(path), batch_size=40, eval_batches=0, prefetch=2)
    stream = build_stream(cfg, split="train", rank=0, world_size=1)
    with pytest.warns(UserWarning, match="malformed Criteo line 81"):
        for _ in range(3):
            next(stream)
    assert stream.num_malformed == 1
    stream.close()



def test_malformed_count_covers_the_batches_consumed_not_those_read_ahead(tmp_path):
    """summary.json's malformed_rows must not depend on data.prefetch."""
    path = tmp_path / "train.txt"
    write_criteo_tsv(_plain(DataConfig(batch_size=40)), str(path), 200)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:100] + ["1\tbad\n"] + lines[100:]))  # in the third batch of 40
    cfg = DataConfig(name="criteo", path=str(path), batch_size=40, eval_batches=0, prefetch=3)
    stream = build_stream(cfg, split="train", rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        next(stream), next(stream)
        deadline = time.monotonic() + 30
        while stream._stream.num_malformed == 0 and time.monotonic() < deadline:  # the worker reads batch 3
            time.sleep(0.01)
        assert stream._stream.num_malformed == 1
        assert stream.num_malformed == 0
        next(stream)
        assert stream.num_malformed == 1
        state = stream.state_dict()
    resumed = build_stream(cfg, split="train", rank=0, world_size=1)
    resumed.load_state_dict(state)
    assert resumed.num_malformed == 1
    stream.close()


class _Failing(BatchStream):
    def __init__(self) -> None:
        self.position = 0

    def __next__(self):
        raise OSError("disk gone")

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def test_worker_errors_surface_in_the_consumer():
    stream = PrefetchStream(_Failing(), depth=2)
    with pytest.raises(OSError, match="disk gone"):
        next(stream)
    with pytest.raises(OSError, match="disk gone"):  # retried, not hung
        next(stream)
    with pytest.raises(ValueError, match="infinite"):
        PrefetchStream(build_stream(CFG, split="eval", rank=0, world_size=1))


def test_abandoned_stream_stops_its_thread():
    stream = build_stream(CFG, split="train", rank=0, world_size=1)
    next(stream)
    thread = stream._thread
    assert thread.is_alive()
    del stream
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def _worker_processes(stream: WorkerProcessStream | StridedWorkerStream) -> list:
    """The stream's worker processes running now (its DataLoader iterator's): none before the first batch and after
    ``close``."""
    return [] if stream._batches is None else list(stream._batches._workers)


def test_abandoned_worker_process_stream_stops_its_processes():
    stream = build_stream(dataclasses.replace(CFG, workers=3), split="train", rank=0, world_size=1)
    assert isinstance(stream, WorkerProcessStream) and _worker_processes(stream) == []
    next(stream)
    processes = _worker_processes(stream)
    assert len(processes) == 3 and all(process.is_alive() for process in processes)
    assert os.getpid() not in [process.pid for process in processes]
    del stream
    gc.collect()
    for process in processes:
        process.join(timeout=10)
    assert not any(process.is_alive() for process in processes)


@pytest.mark.parametrize("workers, depth", [(2, 2), (3, 1), (4, 6)])
def test_worker_processes_yield_the_batches_in_order_with_the_consumers_position(workers, depth):
    plain = _plain()
    fast = build_stream(dataclasses.replace(CFG, workers=workers, prefetch=depth), split="train", rank=0,
                        world_size=1)
    for _ in range(2 * workers + 1):
        assert_batches_equal(next(fast), next(plain))
        assert fast.state_dict() == plain.state_dict()
    assert len(_worker_processes(fast)) == workers
    fast.close()
    assert _worker_processes(fast) == []


def test_worker_processes_close_and_resume_never_skip_batches_made_ahead():
    plain = _plain()
    expected = [next(plain) for _ in range(9)]
    cfg = dataclasses.replace(CFG, workers=3)
    fast = build_stream(cfg, split="train", rank=0, world_size=1)
    for i in range(4):  # the workers have run ahead to batch 6 or beyond
        assert_batches_equal(next(fast), expected[i])
    state = fast.state_dict()
    fast.close()
    assert_batches_equal(next(fast), expected[4])  # restarted at the consumer's position
    assert_batches_equal(next(fast), expected[5])
    resumed = build_stream(dataclasses.replace(cfg, workers=2), split="train", rank=0, world_size=1)
    resumed.load_state_dict(state)  # another worker count resumes the same batches
    for i in (4, 5, 6, 7):
        assert_batches_equal(next(resumed), expected[i])
    one_thread = build_stream(dataclasses.replace(cfg, workers=1), split="train", rank=0, world_size=1)
    one_thread.load_state_dict(resumed.state_dict())  # and so does one thread
    assert_batches_equal(next(one_thread), expected[8])
    for stream in (fast, resumed, one_thread):
        stream.close()


def test_an_error_in_a_worker_process_surfaces_at_its_batch():
    plain = _plain()
    expected = [next(plain) for _ in range(3)]

    def batch_at(index: int):
        if index == 3:
            raise OSError("batch 3 failed")
        return expected[index] if index < 3 else expected[0]

    stream = WorkerProcessStream(IndexedStream(batch_at, identity={}, num_batches=None), depth=4, workers=3)
    for i in range(3):
        assert_batches_equal(next(stream), expected[i])  # the batches before it, although later ones were made
    with pytest.raises(OSError, match="batch 3 failed"):
        next(stream)
    assert stream.state_dict() == {"position": 3} and _worker_processes(stream) == []
    with pytest.raises(OSError, match="batch 3 failed"):  # retried at the failed batch, not past it, not hung
        next(stream)


def test_worker_processes_need_a_random_access_stream():
    with pytest.raises(ValueError, match="random-access stream .*got _Failing"):
        WorkerProcessStream(_Failing(), workers=2)


def _criteo(tmp_path, rows: int, *, malformed_at: int | None = None) -> DataConfig:
    """A Criteo file of ``rows`` rows (a malformed line inserted before row ``malformed_at``), batches of 40."""
    path = tmp_path / "train.txt"
    write_criteo_tsv(_plain(DataConfig(batch_size=40)), str(path), rows)
    if malformed_at is not None:
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(lines[:malformed_at] + ["1\tbad\n"] + lines[malformed_at:]))
    return DataConfig(name="criteo", path=str(path), batch_size=40, eval_batches=0, prefetch=2)


def _one_thread_batches(cfg: DataConfig, count: int) -> list[tuple]:
    """(batch, state after it, malformed rows counted) for the first ``count`` train batches, read in place."""
    plain = build_stream(dataclasses.replace(cfg, prefetch=0), split="train", rank=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [(next(plain), plain.state_dict(), plain.num_malformed) for _ in range(count)]


@pytest.mark.parametrize("workers, depth", [(2, 2), (3, 5)])
def test_criteo_workers_yield_one_threads_batches_positions_and_malformed_counts(tmp_path, workers, depth):
    cfg = _criteo(tmp_path, 200, malformed_at=130)  # 5 batches a pass: the 9 go round the file once
    assert cfg.unread_settings() == []
    expected = _one_thread_batches(cfg, 9)
    assert [count for _, _, count in expected] == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    stream = build_stream(dataclasses.replace(cfg, workers=workers, prefetch=depth), split="train", rank=0,
                          world_size=1)
    assert isinstance(stream, StridedWorkerStream)
    for batch, state, malformed in expected:
        assert_batches_equal(next(stream), batch)
        assert stream.state_dict() == state and stream.num_malformed == malformed
    assert len(_worker_processes(stream)) == workers
    stream.close()
    assert _worker_processes(stream) == []


def test_criteo_workers_close_and_resume_at_the_consumers_batch_with_any_worker_count(tmp_path):
    cfg = _criteo(tmp_path, 200)
    expected = _one_thread_batches(cfg, 8)
    stream = build_stream(dataclasses.replace(cfg, workers=3, prefetch=3), split="train", rank=0, world_size=1)
    for i in range(3):  # the workers have read ahead
        assert_batches_equal(next(stream), expected[i][0])
    state = stream.state_dict()
    stream.close()
    assert_batches_equal(next(stream), expected[3][0])
    resumed = build_stream(dataclasses.replace(cfg, workers=2), split="train", rank=0, world_size=1)
    resumed.load_state_dict(state)
    for i in (3, 4, 5):
        assert_batches_equal(next(resumed), expected[i][0])
    one_thread = build_stream(cfg, split="train", rank=0, world_size=1)
    one_thread.load_state_dict(resumed.state_dict())
    assert_batches_equal(next(one_thread), expected[6][0])
    for each in (stream, resumed, one_thread):
        each.close()


def test_peek_leaves_a_criteo_stream_with_workers_where_it_was(tmp_path):
    from loka_trainer.data.base import peek
    cfg = _criteo(tmp_path, 200)
    expected = _one_thread_batches(cfg, 2)
    stream = build_stream(dataclasses.replace(cfg, workers=2), split="train", rank=0, world_size=1)
    assert_batches_equal(peek(stream), expected[0][0])
    assert_batches_equal(next(stream), expected[0][0])
    assert_batches_equal(next(stream), expected[1][0])
    stream.close()


def test_an_error_in_a_strided_worker_surfaces_and_the_position_stays():
    stream = StridedWorkerStream(_Failing(), depth=2, workers=2)
    with pytest.raises(OSError, match="disk gone"):
        next(stream)
    assert stream.state_dict() == {"position": 0} and _worker_processes(stream) == []
    with pytest.raises(OSError, match="disk gone"):  # retried, not hung
        next(stream)
    with pytest.raises(ValueError, match="infinite"):
        StridedWorkerStream(build_stream(CFG, split="eval", rank=0, world_size=1))


def test_pinned_batches_keep_their_values_and_key_lengths():
    batch = next(_plain()).with_host_key_lengths()
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    pinned = batch.pin_memory()
    assert pinned.dense.is_pinned() and pinned.sparse.values().is_pinned()
    assert_batches_equal(pinned, batch)
    assert pinned.sparse._length_per_key == batch.sparse._length_per_key


# Streams still producing when the script ends: their workers sit in torch ops while the interpreter finalizes.
_EXIT_WITH_RUNNING_WORKERS = """
from loka_trainer.data import DataConfig, build_stream
streams = [build_stream(DataConfig(batch_size=2048, seed=s, workers=w), split="train", rank=0, world_size=1)
           for s, w in ((0, 1), (1, 1), (2, 2))]
for stream in streams:
    next(stream)
print("done")
"""


def test_a_script_that_leaves_train_streams_running_exits_cleanly():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _EXIT_WITH_RUNNING_WORKERS], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-2000:]


@pytest.mark.parametrize("prefetch, workers", [(0, 1), (3, 1), (3, 2)])
def test_peek_returns_the_next_batch_and_leaves_the_stream_where_it_was(prefetch, workers):
    from loka_trainer.data.base import peek
    stream = build_stream(dataclasses.replace(CFG, prefetch=prefetch, workers=workers), split="train", rank=0,
                          world_size=1)
    plain = _plain()
    expected = [next(plain), next(plain)]
    assert_batches_equal(peek(stream), expected[0])
    assert_batches_equal(next(stream), expected[0])
    assert_batches_equal(next(stream), expected[1])
    if prefetch:
        stream.close()
