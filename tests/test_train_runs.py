"""The train.py-driven benchmarks (throughput per precision, probe overhead) and what they read from a run's log
windows (scripts.train_runs): steady throughput, window spread, run order, the probe's in-run cost."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_throughput_bench_runs_train_py_per_precision_and_reuses_finished_runs(tmp_path):
    """Each precision trains through train.py with the same overrides (the order of repeats is
    ``test_repeats_alternate_their_order_and_ratios_pair_runs_of_one_repeat``'s); a second call reuses the runs on
    disk. The table marks a precision data-paced exactly when its wait for data is over
    ``DATA_PACED`` of the step, and then says what to do (``data.prefetch=0``: the batches are made inside the
    step, usually over that share, though how much depends on what else the CPU runs)."""
    from scripts.bench_train_throughput import DATA_PACED
    cmd = [sys.executable, "-m", "scripts.bench_train_throughput", "--out", str(tmp_path), "--precisions", "bf16",
           "fp8_rowwise", "--warmup-steps", "5", "--profile-step", "3", "--", "model=dlrm",
           "trainer.steps=20", "trainer.log_interval=5", "data.prefetch=0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "train_throughput.json").read_text())
    assert list(result["runs"]) == ["bf16", "fp8_rowwise"]
    assert result["command"].startswith("python -m scripts.bench_train_throughput --out") and result["commit"]
    for run in result["runs"].values():
        assert [s for s, _ in run["trajectory"]] == [5, 10, 15, 20] and run["examples_per_s"] > 0
        assert run["window_spread"] >= 0 and run["data_wait_ms"] >= 0
        assert run["data_wait_share"] == pytest.approx(run["data_wait_ms"] / (1000 * 512 / run["examples_per_s"]))
        assert run["profile"]["step"] == 3 and run["profile"]["phases"]["forward"]["host_ms"] > 0
    assert result["precisions"]["bf16"]["ratios"] == [1.0]
    assert result["precisions"]["fp8_rowwise"]["ratios"] == [pytest.approx(
        result["runs"]["fp8_rowwise"]["examples_per_s"] / result["runs"]["bf16"]["examples_per_s"])]
    assert (tmp_path / "train_throughput.png").stat().st_size > 0
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "data wait ms" in line)
    rows = {line.split()[0]: line for line in lines[header + 1:header + 1 + len(result["precisions"])]}
    shares = {name: result["runs"][name]["data_wait_share"] for name in result["precisions"]}
    assert set(rows) == set(shares)
    assert all(("data-paced" in rows[n]) == (shares[n] > DATA_PACED) for n in shares)  # the mark follows the share
    assert ("\ndata-paced: " in proc.stdout) == any(v > DATA_PACED for v in shares.values())
    assert "step 3 by phase" in proc.stdout and "forward" in proc.stdout.split("step 3 by phase")[1]
    mtime = (tmp_path / "runs" / "bf16" / "metrics.jsonl").stat().st_mtime
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and (tmp_path / "runs" / "bf16" / "metrics.jsonl").stat().st_mtime == mtime


def test_a_run_is_marked_data_paced_or_unsteady_only_above_its_threshold():
    from scripts.bench_train_throughput import DATA_PACED, UNSTEADY, run_flags
    assert run_flags(UNSTEADY / 2, DATA_PACED / 2) == []
    assert run_flags(UNSTEADY / 2, None) == []
    assert run_flags(UNSTEADY / 2, DATA_PACED * 1.5) == ["data-paced"]
    assert run_flags(UNSTEADY * 1.5, DATA_PACED * 1.5) == ["unsteady", "data-paced"]
    assert run_flags(UNSTEADY * 1.5, DATA_PACED) == ["unsteady"]


def test_window_spread_separates_a_steady_run_from_one_that_slowed_down():
    from scripts.train_runs import window_spread
    steady = [[s, 100.0 + (s % 20) / 10] for s in range(10, 310, 10)]  # within 2%
    slowed = [[s, 100.0 if s < 200 else 60.0] for s in range(10, 310, 10)]  # the last third at 60%
    assert window_spread(steady, warmup_steps=50) < 0.03
    assert window_spread(slowed, warmup_steps=50) == pytest.approx(0.4)
    assert window_spread(slowed, warmup_steps=200) == 0.0  # after step 200 it is steady again, just slower
    with pytest.raises(SystemExit):
        window_spread(steady, warmup_steps=300)


def test_data_wait_share_is_the_wait_over_the_step_time_of_all_ranks():
    from scripts.train_runs import data_wait_share
    assert data_wait_share(19.0, examples_per_s=60_000.0, examples_per_step=4096) == pytest.approx(19.0 / 68.2666, 1e-4)
    assert data_wait_share(5.0, examples_per_s=1000.0, examples_per_step=2 * 5) == pytest.approx(0.5)  # 10 ms steps
    assert data_wait_share(None, examples_per_s=1000.0, examples_per_step=10) is None


def test_data_wait_is_the_mean_after_the_warm_up_and_absent_where_the_run_did_not_log_it():
    from scripts.train_runs import steady_data_wait
    records = [{"step": 5, "loss": 1.0, "data_wait_ms": 90.0}, {"step": 10, "loss": 1.0, "data_wait_ms": 3.0},
               {"step": 10, "eval_logloss": 0.5}, {"step": 15, "loss": 1.0, "data_wait_ms": 5.0}]
    assert steady_data_wait(records, warmup_steps=5) == pytest.approx(4.0)
    assert steady_data_wait([{"step": 10, "loss": 1.0, "examples_per_s": 9.0}], warmup_steps=5) is None


def test_repeats_alternate_their_order_and_ratios_pair_runs_of_one_repeat():
    from scripts.bench_train_throughput import run_key, summarize
    from scripts.train_runs import repeat_orders
    assert repeat_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    # repeat 1 ran on a machine 2x slower: ratios within a repeat stay 1.2, a ratio of medians across them would not
    rates = {("a", 0): 100.0, ("b", 0): 120.0, ("a", 1): 50.0, ("b", 1): 60.0, ("a", 2): 100.0, ("b", 2): 120.0}
    runs = {run_key(p, r): {"examples_per_s": v, "window_spread": 0.01 * (r + 1)} for (p, r), v in rates.items()}
    assert set(runs) == {"a", "b", "a#1", "b#1", "a#2", "b#2"}
    table = summarize(runs, ["a", "b"], 3)
    assert table["b"]["ratios"] == pytest.approx([1.2, 1.2, 1.2]) and table["b"]["ratio_to_first"] == pytest.approx(1.2)
    assert table["b"]["examples_per_s"] == 120.0 and table["a"]["max_window_spread"] == pytest.approx(0.03)


def test_observed_step_overhead_reads_the_probe_cost_inside_one_run():
    """Windows of 10 steps at 100 examples/s; the two holding an observed step (steps 200 and 300) run at 50/s,
    i.e. take one extra window each: 10 extra steps per observation, 2 windows over 20 measured = 10%."""
    from scripts.train_runs import observed_step_overhead
    trajectory = [[s, 50.0 if s in (210, 310) else 100.0] for s in range(10, 360, 10)]
    result = observed_step_overhead(trajectory, interval=100, warmup_steps=150)
    assert result["observed_windows"] == [210, 310]
    assert result["extra_steps_per_observation"] == pytest.approx(10.0)
    assert result["overhead"] == pytest.approx(2 / 20)
    with pytest.raises(SystemExit):  # nothing observed after the warm-up
        observed_step_overhead(trajectory, interval=1000, warmup_steps=150)


def test_observed_step_overhead_compares_with_neighbouring_windows_not_the_whole_run():
    """From step 250 on the machine runs at half speed; the observation at 300 costs one window there as at 200.
    Against the run's median unobserved window the slow phase would count as probe cost (and the observation
    inside it twice over)."""
    from scripts.train_runs import observed_step_overhead
    base = {s: 100.0 if s <= 250 else 50.0 for s in range(10, 410, 10)}
    trajectory = [[s, base[s] / 2 if s in (210, 310) else base[s]] for s in range(10, 410, 10)]
    result = observed_step_overhead(trajectory, interval=100, warmup_steps=150)
    assert result["observed_windows"] == [210, 310]
    assert result["extra_steps_per_observation"] == pytest.approx(10.0)
    assert result["overhead"] == pytest.approx(2 / 25)


@pytest.mark.slow
def test_probe_overhead_bench_reads_the_cost_inside_the_probe_on_run(tmp_path):
    """A pair through train.py: the probe-on run observes at steps 0 and 10 and reports its in-run overhead, and
    every run its window spread."""
    cmd = [sys.executable, "-m", "scripts.bench_probe_overhead", "--out", str(tmp_path), "--pairs", "1",
           "--warmup-steps", "5", "--interval", "10", "--profile-step", "0", "--", "model=dlrm", "trainer.steps=20",
           "trainer.log_interval=5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "probe_overhead.json").read_text())
    assert result["command"].startswith("python -m scripts.bench_probe_overhead --out") and result["date"]
    runs = {r["probe"]: r for r in result["runs"]}
    assert all(r["window_spread"] >= 0 for r in runs.values())
    assert all(r["profile"]["step"] == 0 and "forward" in r["profile"]["phases"] for r in runs.values())
    assert "pair 0 on" in proc.stdout.split("step 0 by phase")[1]
    assert runs["on"]["in_run"]["observed_windows"] == [15] and "in_run" not in runs["off"]


def test_an_interval_longer_than_the_run_measures_hooks_without_observations():
    from scripts.train_runs import observes
    assert observes(150, 350, 100)  # steps 200, 300
    assert not observes(150, 350, 100_000)  # only step 0, inside the warm-up
    assert not observes(150, 199, 100)


def test_throughput_variants_of_the_command_line_join_the_known_ones_and_bad_names_fail_in_one_line():
    from scripts.bench_train_throughput import run_variants

    variants = run_variants(["bf16", "bf16_no_fsdp", "fp8_tensorwise_auto"],
                            [("bf16_no_fsdp", "precision=bf16 sharding.fsdp=false")])
    assert variants == {"bf16": ["precision=bf16"], "bf16_no_fsdp": ["precision=bf16", "sharding.fsdp=false"],
                        "fp8_tensorwise_auto": ["precision=fp8_tensorwise", "precision.fp8_filter=auto"]}
    for names, custom, needle in ((["bf16", "nope"], [], "unknown ['nope']"),
                                  (["loka"], [("loka", "precision=bf16")], "already name a precision"),
                                  (["mine"], [("mine", "  ")], "has no overrides")):
        with pytest.raises(SystemExit, match=re.escape(needle)):
            run_variants(names, custom)


@pytest.mark.parametrize("script, args, needle", [
    ("bench_train_throughput", ["--out", "{file}/out", "--", "model=dlrm"], "argument --out: cannot write to"),
    ("bench_train_throughput", ["--out", "{tmp}", "--nproc", "0", "--", "model=dlrm"],
     "argument --nproc: must be >= 1, got 0"),
    ("bench_train_throughput", ["--out", "{tmp}", "--", "model=nosuch"], "Could not find 'model/nosuch'"),
    ("bench_train_throughput", ["--out", "{tmp}", "--precisions", "bf16", "--warmup-steps", "500", "--",
                                "model=dlrm", "trainer.steps=510"], "logs 1 window(s) after --warmup-steps 500"),
    ("bench_train_throughput", ["--out", "{tmp}", "--precisions", "bf16", "loka", "bf16", "--", "model=dlrm"],
     "--precisions: bf16 given more than once"),
    ("bench_probe_overhead", ["--out", "{tmp}", "--pairs", "0", "--", "model=dlrm"], "argument --pairs: must be >= 1"),
    ("bench_probe_overhead", ["--out", "{tmp}", "--", "model=dlrm", "trainer.lr=-1"], "trainer.lr"),
    ("quality_runs", ["--out", "{file}/q", "--precisions", "bf16"], "argument --out: cannot write to"),
    ("fp8_layer_sensitivity", ["--out", "{file}/s", "--model", "dlrm"], "argument --out: cannot write to"),
    ("fp8_layer_sensitivity", ["--out", "{tmp}/s.json", "--model", "nosuch"], "model preset 'nosuch'"),
    ("fp8_layer_sensitivity", ["--out", "{tmp}/s.json", "--model", "dlrm", "--", "model.nosuch=1"],
     "Key 'nosuch' not in 'DLRMConfig'"),
    ("outlier_activations", ["--out", "{tmp}/o.json", "--model", "dlrm", "--", "data.nosuch=1"],
     "Key 'nosuch' not in 'DataConfig'"),
])
def test_train_py_benchmarks_reject_bad_arguments_before_any_run(tmp_path, script, args, needle):
    """A bad folder, count or train.py override fails when the command line is read: no run starts, nothing is
    written (these were tracebacks, or a failed run after the earlier runs had trained)."""
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "out"
    args = [a.format(file=tmp_path / "a_file", tmp=out) for a in args]
    proc = subprocess.run([sys.executable, "-m", f"scripts.{script}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


def test_logged_windows_after_the_warm_up_count_the_multiples_of_the_log_interval():
    from scripts.train_runs import logged_windows_after

    assert logged_windows_after(20, 5, 5) == 3  # steps 10, 15, 20
    assert logged_windows_after(510, 10, 500) == 1
    assert logged_windows_after(100, 10, 200) == 0


@pytest.mark.parametrize("content", ["{bad", '["a list"]', '{"overrides": []}'])
def test_a_damaged_result_file_stops_the_benchmark_before_any_run_and_is_kept(tmp_path, content):
    """The result JSON a call resumes from holds earlier runs: damaged, it is refused in one line and left as it
    is (it was a traceback, or with a readable file lacking "runs" a KeyError)."""
    (tmp_path / "train_throughput.json").write_text(content)
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_train_throughput", "--out", str(tmp_path),
                           "--precisions", "bf16", "--", "model=dlrm", "trainer.steps=150"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "train_throughput.json is damaged" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and (tmp_path / "train_throughput.json").read_text() == content
    assert not (tmp_path / "runs").exists()
