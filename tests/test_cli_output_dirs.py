"""train.py's output directories on the command line: each directory a run writes to (the run dir, checkpoints, the
Probe's) must be writable and, under ``-m``, belong to one sweep point; refused in one line before anything is
written. Also the host-memory bound of the pre-flight."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import run_train
from tests.test_cli import TINY, _one_error_line

@pytest.mark.parametrize("option", ["hydra.run.dir", "trainer.checkpoint_dir", "callbacks.probe.out_dir"])
def test_an_output_dir_that_cannot_be_written_is_one_line_before_training(tmp_path, option):
    (tmp_path / "a_file").write_text("")
    target = tmp_path / "a_file" / "out"
    args = [*TINY, f"{option}={target}"] + ([] if option == "hydra.run.dir" else [f"hydra.run.dir={tmp_path}/run"])
    args += ["callbacks.probe.enabled=true"] if option.startswith("callbacks.probe") else []
    line = _one_error_line(run_train(args, check=False, timeout=120), f"{option}: cannot write to {target}",
                           "a_file is not a directory")
    assert line.startswith("error:")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_checkpoint_dir_where_no_file_can_be_created_is_refused_before_the_run_dir_exists(tmp_path):
    """trainer.checkpoint_dir=/proc/x passed the permission bits (root), trained, and failed at the first save."""
    args = [*TINY, "trainer.checkpoint_dir=/proc/loka_ckpt", f"hydra.run.dir={tmp_path}/run"]
    _one_error_line(run_train(args, check=False, timeout=120), "trainer.checkpoint_dir: cannot write to "
                    "/proc/loka_ckpt (cannot create a file in /proc: No such file or directory)")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_probe_out_dir_where_no_file_can_be_created_is_refused_before_the_run_dir_exists(tmp_path):
    """callbacks.probe.out_dir=/proc/x was refused only once Hydra had made an empty run dir."""
    args = [*TINY, "callbacks.probe.enabled=true", "callbacks.probe.out_dir=/proc/loka_probe",
            f"hydra.run.dir={tmp_path}/run"]
    _one_error_line(run_train(args, check=False, timeout=120), "callbacks.probe.out_dir: cannot write to "
                    "/proc/loka_probe (cannot create a file in /proc: No such file or directory)")
    assert not (tmp_path / "run").exists()


def test_sweep_points_sharing_one_probe_out_dir_are_one_line_before_anything_is_written(tmp_path):
    """Each later point moved the earlier point's Probe stats into previous/: refused like a shared checkpoint_dir."""
    shared = tmp_path / "probe"
    args = ["-m", *TINY, "precision=bf16,fp32", "callbacks.probe.enabled=true", f"callbacks.probe.out_dir={shared}",
            f"hydra.sweep.dir={tmp_path}/sweep"]
    _one_error_line(run_train(args, check=False, timeout=120),
                    f"callbacks.probe.out_dir={shared} is shared by the sweep points precision=bf16 and "
                    f"precision=fp32", "Probe stats to previous/")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_two_sweep_points_write_is_named_once_with_both_points_and_settings(tmp_path):
    from loka_trainer.cli import shared_dir_line

    ck, pr = ("trainer.checkpoint_dir", "callbacks.probe.out_dir")
    bf16, fp32 = ["precision=bf16", "seed=1"], ["precision=fp32", "seed=1"]
    assert shared_dir_line([(bf16, [(ck, tmp_path / "a"), (pr, tmp_path / "a")]), (fp32, [(ck, tmp_path / "b")])]) \
        is None  # one point's own settings may share a directory
    line = shared_dir_line([(bf16, [(ck, tmp_path / "a")]), (fp32, [(ck, tmp_path / "b"), (pr, tmp_path / "a")])])
    assert line.startswith(f"{ck}={tmp_path / 'a'} of the sweep point precision=bf16 is {pr}={tmp_path / 'a'} of "
                           f"the sweep point precision=fp32: "), line
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    line = shared_dir_line([(bf16, [(pr, tmp_path / "real")]), (fp32, [(pr, tmp_path / "link/")])])
    assert line is not None and f"{pr}={tmp_path / 'link'} of the sweep point precision=fp32" in line
    assert shared_dir_line([(bf16, [(pr, tmp_path / "a")]), (list(bf16), [(pr, tmp_path / "a")])]).startswith(
        f"{pr}={tmp_path / 'a'} is shared by the sweep points #0 and #1: ")


def test_the_output_dirs_a_run_writes_default_to_its_run_dir_and_a_sweep_checks_only_the_explicit_ones():
    from omegaconf import OmegaConf

    from loka_trainer.launch import output_dirs

    cfg = OmegaConf.create({"trainer": {"checkpoint_dir": None},
                            "callbacks": {"probe": {"enabled": False, "out_dir": None}}})
    assert output_dirs(cfg, Path("run")) == [("trainer.checkpoint_dir", Path("run/checkpoints"))]
    assert output_dirs(cfg, None) == []
    cfg.callbacks.probe.enabled = True
    assert output_dirs(cfg, Path("run"))[1:] == [("callbacks.probe.out_dir", Path("run/probe"))]
    assert output_dirs(cfg, None) == []
    cfg.trainer.checkpoint_dir, cfg.callbacks.probe.out_dir = "ck", "pr"
    assert output_dirs(cfg, None) == [("trainer.checkpoint_dir", Path("ck")), ("callbacks.probe.out_dir", Path("pr"))]


def test_a_default_output_dir_that_cannot_be_written_is_one_line_and_the_run_dir_is_left_as_it_was(tmp_path):
    """<run dir>/checkpoints or <run dir>/probe taken by a file: refused in the pre-flight, nothing is added."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("checkpoints", "probe"):
        (run_dir / name).write_text("")
    args = [*TINY, "callbacks.probe.enabled=true", f"hydra.run.dir={run_dir}"]
    _one_error_line(run_train(args, check=False, timeout=120), f"trainer.checkpoint_dir: cannot write to "
                    f"{run_dir / 'checkpoints'} ({run_dir / 'checkpoints'} is not a directory)")
    (run_dir / "checkpoints").unlink()
    _one_error_line(run_train(args, check=False, timeout=120), f"callbacks.probe.out_dir: cannot write to "
                    f"{run_dir / 'probe'} ({run_dir / 'probe'} is not a directory)")
    assert sorted(p.name for p in run_dir.iterdir()) == ["probe"]


def test_ids_that_cannot_fit_in_host_memory_are_one_line_before_the_run_dir_exists(tmp_path):
    """data.multi_hot=1000 ran out of memory drawing the synthetic teacher's sample, after .hydra/ was written."""
    args = [*TINY, "data.multi_hot=1000000", f"hydra.run.dir={tmp_path}/run"]
    _one_error_line(run_train(args, check=False, timeout=120), "host memory: this run needs at least",
                    "lower data.multi_hot")
    assert not (tmp_path / "run").exists()


def test_one_directory_for_checkpoints_and_probe_stats_resumes_from_its_checkpoint_and_a_fresh_start_keeps_both(
        tmp_path):
    """trainer.checkpoint_dir=D callbacks.probe.out_dir=D: stats.pt beside step_NNNNNN/ and latest. The resumed run
    reads D/step_000002 and ends with the Probe stats of an uninterrupted run; a fresh start moves the checkpoints to
    <run dir>/previous/ and stats.pt to D/previous/, and neither move takes the other's files."""
    import torch

    shared, run_dir = tmp_path / "D", tmp_path / "run"
    args = [*(a for a in TINY if not a.startswith("trainer.steps=")), "trainer.steps=4",
            "trainer.checkpoint_interval=2", "callbacks.probe.enabled=true", "callbacks.probe.interval=1",
            "callbacks.probe.tensorboard=false", f"trainer.checkpoint_dir={shared}",
            f"callbacks.probe.out_dir={shared}", f"hydra.run.dir={run_dir}"]
    run_train([*args, "trainer.stop_after=2"], timeout=300)
    assert sorted(p.name for p in shared.iterdir()) == ["latest", "stats.pt", "step_000002"]
    resumed = run_train(args, timeout=300)
    assert f"resumed from {shared / 'step_000002'} at step 2" in resumed.stdout, resumed.stdout[-2000:]
    assert (shared / "latest").read_text().strip() == "step_000004"
    resumed_stats = torch.load(shared / "stats.pt", weights_only=False)

    fresh = run_train([*args, "trainer.resume=false"], timeout=300)
    assert "Probe files in callbacks.probe.out_dir (stats.pt) were moved" in fresh.stdout, fresh.stdout[-2000:]
    [ckpt_aside] = (run_dir / "previous").iterdir()
    assert sorted(p.name for p in (ckpt_aside / "checkpoints").iterdir()) == ["latest", "step_000002",
                                                                               "step_000004"]
    [stats_aside] = (shared / "previous").iterdir()
    assert sorted(p.name for p in stats_aside.iterdir()) == ["stats.pt"]
    assert torch.load(stats_aside / "stats.pt", weights_only=False)["sha256"] == resumed_stats["sha256"]
    assert sorted(p.name for p in shared.iterdir()) == ["latest", "previous", "stats.pt", "step_000002",
                                                        "step_000004"]
    uninterrupted = torch.load(shared / "stats.pt", weights_only=False)
    assert (uninterrupted["step"], uninterrupted["sha256"]) == (resumed_stats["step"], resumed_stats["sha256"])
