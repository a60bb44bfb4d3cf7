"""A checkpoint save that fails (a full disk, on one rank or all): one line, the same on every rank, and the
earlier complete checkpoints stay what a restart resumes from."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from loka_trainer import checkpoint as ckpt
from loka_trainer.resume import plan_start
from tests.test_checkpoint_files import _save


def test_a_save_on_a_full_disk_fails_in_one_line_and_leaves_the_earlier_checkpoint(tmp_path, monkeypatch):
    """DCP's own failure of a short write was a CheckpointException (a BaseException) with a traceback per rank and
    'unexpected pos 704 vs 598' as its only clue: the run now stops with one line naming the space left."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_files

    root = tmp_path / "checkpoints"
    _save(root, 2)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", full)
    with pytest.raises(ckpt.CheckpointError) as info:
        _save(root, 4)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"could not write checkpoint {root / 'step_000004'} (OSError: ")
    assert "No space left on device" in line and "MiB free there" in line
    assert plan_start(root, resume=True, world_size=1).step == 2  # the incomplete one is skipped, the earlier stays


def test_a_save_whose_latest_pointer_fails_says_the_checkpoint_is_complete(tmp_path, monkeypatch):
    """Only ``latest`` (for people; a resume scans the directories) could not be written: one line that says the
    checkpoint itself is complete, and a restart resumes from it."""
    import errno

    root = tmp_path / "checkpoints"
    write_text = ckpt.atomic_write_text

    def no_latest(path, text):
        if Path(path).name == ckpt.LATEST:
            raise OSError(errno.EACCES, "Permission denied")
        write_text(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", no_latest)
    with pytest.raises(ckpt.CheckpointError) as info:
        _save(root, 2)
    line = str(info.value)
    assert line.startswith(f"could not point {root / 'latest'} at checkpoint {root / 'step_000002'} (PermissionError: ")
    assert "the checkpoint is complete and a restart resumes from it" in line
    assert plan_start(root, resume=True, world_size=1).step == 2


def _one_rank_fails_worker(rank: int, root: str) -> None:
    """Step 2 saves; step 4 fails writing rank 1's rank file, step 6 writing rank 0's marker: every rank must raise
    the same one-line error naming the failing rank (a rank raising alone left the others in the next barrier)."""
    import errno

    root = Path(root)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())

    def save(step: int) -> Path:
        return ckpt.save_checkpoint(root, step, model=model, dense_optimizer=opt, sparse_optimizer=None,
                                    extra={"step": step}, local={"train_stream": {"position": step}},
                                    rank=rank, world_size=2)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    save(2)
    for step, failing, name in ((4, 1, "atomic_write"), (6, 0, "_write_marker")):
        original = getattr(ckpt, name)
        if rank == failing:
            setattr(ckpt, name, full)
        try:
            with pytest.raises(ckpt.CheckpointError) as info:
                save(step)
        finally:
            setattr(ckpt, name, original)
        line = str(info.value)
        where = f"could not write checkpoint {ckpt.step_dir(root, step)} (rank {failing}: OSError: "
        assert line.startswith(where), (rank, line)
        assert "No space left on device" in line and "MiB free there" in line and "\n" not in line
        assert plan_start(root, resume=True, world_size=2).step == 2  # the earlier checkpoint stays the newest


@pytest.mark.slow
def test_a_save_failing_on_one_rank_stops_every_rank_with_the_same_line(tmp_path):
    from tests.spawn import run_on_ranks

    run_on_ranks(_one_rank_fails_worker, 2, str(tmp_path / "checkpoints"))
