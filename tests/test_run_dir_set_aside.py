"""What a start does to the run directory it finds (no process group, seconds): a fresh start moves the earlier
run aside (keeping the plan or Probe report it is told to read), a resume keeps one metrics series and sets aside
what follows its checkpoint."""
from __future__ import annotations

import json

import pytest

from loka_trainer import checkpoint as ckpt
from loka_trainer.resume import plan_start, prepare_resumed_run, set_aside_previous_run, set_aside_probe_outputs
from tests.test_checkpoint_files import _tree, three_checkpoints


@pytest.fixture()
def three(tmp_path):
    return three_checkpoints(tmp_path)


def test_fresh_start_moves_the_earlier_run_aside_untouched(three):
    root, _ = three
    run_dir = root.parent
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.7}\n')
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("a: 1\n")
    (run_dir / "profile.json").write_text('{"steps": []}\n')  # the profiler's: it must not pass for the new run's
    before_ckpt, before_metrics = _tree(root), (run_dir / "metrics.jsonl").read_bytes()
    [line] = set_aside_previous_run(run_dir, root)
    [dest] = list((run_dir / "previous").iterdir())
    assert not (run_dir / "profile.json").exists() and (dest / "profile.json").read_text() == '{"steps": []}\n'
    assert str(dest) in line and "metrics.jsonl" in line
    assert _tree(dest / "checkpoints") == before_ckpt  # same bytes, same mtimes: moved, not rewritten
    assert (dest / "metrics.jsonl").read_bytes() == before_metrics
    assert (dest / ".hydra" / "config.yaml").read_text() == "a: 1\n"
    assert not (run_dir / "metrics.jsonl").exists() and ckpt.checkpoint_dirs(root) == []
    assert set_aside_previous_run(run_dir, root) == []  # nothing left to move: no empty folder, no line


def test_fresh_start_keeps_the_plan_file_it_is_told_to_run(tmp_path):
    """precision.plan=<run dir>/dispatch_plan.json with a fresh start: the plan is copied aside, not moved away
    from under the run that reads it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = run_dir / "dispatch_plan.json"
    plan.write_text('{"version": 1, "layers": {}}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    [line] = set_aside_previous_run(run_dir, run_dir / "checkpoints", inputs=[plan])
    [dest] = list((run_dir / "previous").iterdir())
    assert plan.read_text() == (dest / "dispatch_plan.json").read_text() == '{"version": 1, "layers": {}}\n'
    assert not (run_dir / "metrics.jsonl").exists() and (dest / "metrics.jsonl").exists()


def test_fresh_start_keeps_the_probe_report_it_is_told_to_read_in_place(tmp_path):
    """precision.probe_stats=<run dir>/probe with a fresh start in that run directory: the earlier probe/ moves
    aside whole, and the report this run reads is back at its place (same bytes); the rest of probe/ is not."""
    run_dir = tmp_path / "run"
    (run_dir / "probe").mkdir(parents=True)
    report = run_dir / "probe" / "report.json"
    report.write_text('{"version": 1}\n')
    (run_dir / "probe" / "stats.pt").write_bytes(b"PK stats")
    [line] = set_aside_previous_run(run_dir, run_dir / "checkpoints", inputs=[report])
    [dest] = list((run_dir / "previous").iterdir())
    assert report.read_text() == (dest / "probe" / "report.json").read_text() == '{"version": 1}\n'
    assert (dest / "probe" / "stats.pt").read_bytes() == b"PK stats" and not (run_dir / "probe" / "stats.pt").exists()
    assert "probe" in line


def test_fresh_start_moves_the_probe_files_of_an_explicit_out_dir_aside(tmp_path):
    """callbacks.probe.out_dir outside the run directory: an earlier run's stats.pt and report move to
    <out_dir>/previous/<stamp>/ (same bytes), the report this run reads (precision.probe_stats) is copied, a file
    that is not the Probe's stays."""
    out = tmp_path / "shared_probe"
    out.mkdir()
    files = {"stats.pt": b"PK\x03\x04 earlier stats", "report.json": b'{"version": 1}\n', "report.png": b"png"}
    for name, data in files.items():
        (out / name).write_bytes(data)
    (out / "notes.txt").write_text("mine\n")
    [line] = set_aside_probe_outputs(out, inputs=[out / "report.json"])
    [dest] = list((out / "previous").iterdir())
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == files
    assert str(dest) in line and "stats.pt" in line and "callbacks.probe.out_dir" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "previous", "report.json"]
    assert (out / "report.json").read_bytes() == files["report.json"]
    (out / "report.json").unlink()
    assert set_aside_probe_outputs(out) == []  # nothing left to move: no empty folder, no line
    assert set_aside_probe_outputs(tmp_path / "missing") == [] and not (tmp_path / "missing").exists()


def test_resume_keeps_one_metrics_series_and_moves_newer_incomplete_checkpoints(three):
    root, paths = three
    run_dir = root.parent
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 8)] + [{"step": 6, "eval_auc": 0.6}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (paths[-1] / ".metadata").unlink()
    plan = plan_start(root, resume=True, world_size=1)
    good = _tree(paths[0]), _tree(paths[1])
    lines = prepare_resumed_run(run_dir, root, plan, steps=10)
    assert len(lines) == 2
    kept = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [1, 2, 3, 4]
    [dest] = list((run_dir / "previous").iterdir())
    assert len((dest / "metrics.jsonl").read_text().splitlines()) == len(records)  # the original, whole
    assert (dest / "checkpoints" / "step_000006").is_dir() and not paths[-1].exists()
    assert (_tree(paths[0]), _tree(paths[1])) == good
    assert (root / ckpt.LATEST).read_text() == "step_000004"


def test_a_resume_sets_aside_cut_records_and_a_latest_that_is_not_a_file(three):
    """A kill mid-write leaves a cut last line (no newline, or NUL bytes): it goes to previous/, the file ends in a
    newline again; a `latest` that is a directory or not UTF-8 text is replaced (it is only a pointer)."""
    root, paths = three
    run_dir = root.parent
    whole = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 5))
    (run_dir / "metrics.jsonl").write_bytes(whole.encode() + b'{"step": 5, "lo\xff\x00\x00')
    (root / ckpt.LATEST).unlink()
    (root / ckpt.LATEST).mkdir()
    plan = plan_start(root, resume=True, world_size=1)
    lines = prepare_resumed_run(run_dir, root, plan, steps=10)
    assert (run_dir / "metrics.jsonl").read_text() == whole  # cut line gone, ends in a newline
    [dest] = list((run_dir / "previous").iterdir())
    assert (dest / "metrics.jsonl").read_bytes().endswith(b"\x00") and (dest / ckpt.LATEST).is_dir()
    assert (root / ckpt.LATEST).read_text() == plan.checkpoint.name and len(lines) == 2
    (root / ckpt.LATEST).write_bytes(b"\xff\xfe\x00garbage")
    prepare_resumed_run(run_dir, root, plan, steps=10)
    assert (root / ckpt.LATEST).read_text() == plan.checkpoint.name


def test_a_resume_at_the_last_step_drops_the_final_evaluation_it_runs_again(three):
    root, paths = three
    run_dir = root.parent
    plan = plan_start(root, resume=True, world_size=1)
    records = [{"step": s, "loss": 1.0} for s in range(1, plan.step + 1)] + [{"step": plan.step, "eval_auc": 0.6}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_resumed_run(run_dir, root, plan, steps=plan.step + 5)  # a mid-run eval at the checkpoint's step stays
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == len(records)
    prepare_resumed_run(run_dir, root, plan, steps=plan.step)  # the run's end: its final eval follows
    assert [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == records[:-1]
