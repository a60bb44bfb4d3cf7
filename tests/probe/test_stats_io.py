from __future__ import annotations

import threading
import time

import pytest
import torch

from loka_trainer.probe.stats_io import STATS_VERSION, AsyncSaver, atomic_save, load_stats, seal_stats


def _valid_stats(num_in: int = 4, num_out: int = 3) -> dict:
    return seal_stats(_unsealed_stats(num_in, num_out))


def _unsealed_stats(num_in: int = 4, num_out: int = 3) -> dict:
    x = torch.randn(50, num_in, dtype=torch.float64)
    xc = x - x.mean(0)
    return {"version": STATS_VERSION, "step": 9, "world_size": 1, "layers": {"fc": {
        "in_features": num_in, "out_features": num_out, "has_bias": False,
        "activation": {"count": torch.tensor(50.0, dtype=torch.float64), "mean": x.mean(0),
                       "scatter": (xc.T @ xc)[None], "max_abs": x.abs().amax(0), "representation": "full",
                       "rows_per_call": 50},
        "weight": {"count": 1, "mean": torch.randn(num_out, num_in, dtype=torch.float64),
                   "u": torch.eye(num_out, dtype=torch.float64), "v": torch.eye(num_in, dtype=torch.float64),
                   "momentum": 0.99, "representation": "U:full,V:full"}}}}


def test_crash_during_write_leaves_previous_file_loadable(tmp_path):
    path = tmp_path / "stats.pt"
    first = _valid_stats()
    atomic_save(first, path)

    def crashing_writer(obj, f):
        f.write(b"half a pickle")  # partial bytes hit the disk, then the process "dies"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_save(_valid_stats(), path, writer=crashing_writer)
    loaded = load_stats(path)
    torch.testing.assert_close(loaded["layers"]["fc"]["weight"]["mean"], first["layers"]["fc"]["weight"]["mean"])
    assert [p.name for p in tmp_path.iterdir()] == ["stats.pt"]  # no temp file left behind


def test_async_save_returns_before_the_write_finishes(tmp_path):
    release = threading.Event()
    writing = threading.Event()

    def slow_writer(obj, f):
        writing.set()
        assert release.wait(10)
        torch.save(obj, f)

    saver = AsyncSaver(writer=slow_writer)
    start = time.perf_counter()
    saver.submit(_valid_stats, tmp_path / "stats.pt")
    submit_seconds = time.perf_counter() - start
    assert writing.wait(5) and not (tmp_path / "stats.pt").exists()  # write in progress, caller already back
    assert submit_seconds < 0.5
    release.set()
    saver.close()
    assert load_stats(tmp_path)["step"] == 9


def test_async_save_surfaces_write_errors(tmp_path):
    def failing_writer(obj, f):
        raise OSError("disk full")

    saver = AsyncSaver(writer=failing_writer)
    saver.submit(_valid_stats, tmp_path / "stats.pt")
    with pytest.raises(OSError, match="disk full"):
        saver.wait()


@pytest.mark.parametrize("corrupt, reason", [
    (lambda s: s.update(version=99), "version"),
    (lambda s: s["layers"]["fc"]["activation"]["mean"].fill_(float("nan")), "not finite"),
    (lambda s: s["layers"]["fc"].update(in_features=5), "mean is not"),
    (lambda s: s["layers"]["fc"]["weight"].update(u=torch.eye(2, dtype=torch.float64)), "factors"),
    (lambda s: s["layers"]["fc"]["activation"].update(count=torch.tensor(1.0)), "rows"),
    (lambda s: s.update(layers={}), "no layers"),
])
def test_bad_files_are_rejected_with_a_one_line_reason(tmp_path, corrupt, reason):
    stats = _unsealed_stats()
    corrupt(stats)
    atomic_save(seal_stats(stats), tmp_path / "stats.pt")
    with pytest.raises(ValueError, match=reason) as info:
        load_stats(tmp_path)
    assert "\n" not in str(info.value)


def test_flipped_bytes_inside_the_tensor_payload_are_rejected(tmp_path):
    """torch.load does not notice bytes changed inside a tensor's storage; the checksum does."""
    stats = _valid_stats(num_in=16, num_out=8)
    path = tmp_path / "stats.pt"
    atomic_save(stats, path)
    data = bytearray(path.read_bytes())
    payload = stats["layers"]["fc"]["weight"]["mean"].numpy().tobytes()  # 1024 bytes of fp64
    start = data.find(payload)
    assert start >= 0
    for i in range(start + 400, start + 600):  # 200 bytes in the middle of the weight mean
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["version"] == STATS_VERSION  # still unpickles
    with pytest.raises(ValueError, match="checksum mismatch") as info:
        load_stats(tmp_path)
    assert "\n" not in str(info.value)


def test_a_file_without_checksum_is_rejected(tmp_path):
    atomic_save(_unsealed_stats(), tmp_path / "stats.pt")
    with pytest.raises(ValueError, match="no checksum"):
        load_stats(tmp_path)


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "cannot be read"),  # truncated
    (lambda p: p.write_bytes(b""), "cannot be read"),  # empty
    (lambda p: p.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                           generator=torch.Generator().manual_seed(0)).numpy().tobytes()),
     "cannot be read"),  # random bytes
    (lambda p: p.unlink(), "file not found"),  # missing
])
def test_damaged_or_missing_files_are_rejected(tmp_path, damage, reason):
    path = tmp_path / "stats.pt"
    atomic_save(_valid_stats(), path)
    damage(path)
    with pytest.raises(ValueError, match=reason) as info:
        load_stats(tmp_path)
    assert "\n" not in str(info.value)
