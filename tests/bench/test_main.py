"""``python -m loka_trainer.bench`` end to end, against a throwaway conf dir (the real model/data groups are
tested by their owners; here the example provider keeps the run small)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def conf_dir(tmp_path: Path) -> Path:
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "data").mkdir()
    shutil.copy(ROOT / "conf" / "bench.yaml", conf / "bench.yaml")
    (conf / "model" / "dlrm.yaml").write_text("name: dlrm\n")
    (conf / "data" / "synthetic.yaml").write_text("name: synthetic\nbatch_size: 4\n")
    return conf


def _run(conf_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LOKA_CONF_DIR=str(conf_dir))
    return subprocess.run([sys.executable, "-m", "loka_trainer.bench", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_table_and_icicle(conf_dir, tmp_path):
    out = tmp_path / "run"
    proc = _run(conf_dir, "bench.provider=example", "bench.example=mlp_tree", "bench.depth=2",
                "bench.repeats=1", "bench.warmup=0", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "bench_mlp_tree.csv").read_text().count("\n") == 1 + 9  # header + 9 modules
    assert "model.left.2" in (out / "bench_mlp_tree_icicle.html").read_text()
    assert "bench:" in proc.stderr  # tqdm progress bar over submodules


@pytest.mark.parametrize("override, needle", [
    ("bench.color_by=rainbow", "bench.color_by='rainbow' is unknown"),
    ("bench.results=[pdf]", "bench.results='pdf' is unknown; valid values: ['csv', 'icicle'"),
    ("bench.depth=abc", "bench.depth: must be an integer, got str 'abc'"),
    ("bench.include=[nomatch*]", "bench.include: ['nomatch*'] match(es) no submodule"),
])
def test_cli_bad_option_is_one_line_exit_2_and_writes_nothing(conf_dir, tmp_path, override, needle):
    out = tmp_path / "r"
    proc = _run(conf_dir, "bench.provider=example", "bench.example=mlp_tree", override, f"hydra.run.dir={out}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and needle in line, line
    assert not out.exists()


@pytest.mark.parametrize("flags, needle", [
    (["--help"], "loka_trainer.bench is powered by Hydra."),
    (["-h"], "== Config =="),
    (["--cfg", "job", "bench.depth=5"], "  depth: 5\n"),
])
def test_cli_hydra_flags_print_and_run_nothing(conf_dir, tmp_path, flags, needle):
    out = tmp_path / "r"
    proc = _run(conf_dir, *flags, f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert needle in proc.stdout and "bench:" in proc.stdout
    assert not out.exists()


@pytest.mark.parametrize("flags, needle", [
    (["--cfg", "job"], "  depth: 5\n"),
    (["--help"], "loka_trainer.bench is powered by Hydra."),
])
def test_cli_hydra_flags_after_the_overrides(conf_dir, tmp_path, flags, needle):
    out = tmp_path / "r"
    proc = _run(conf_dir, "bench.depth=5", f"hydra.run.dir={out}", *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert needle in proc.stdout and not out.exists()


def test_cli_info_alone_prints_hydras_info():
    proc = _run(ROOT / "conf", "--info")  # its value is optional: nothing may follow it unasked
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Config search path" in proc.stdout


def test_cli_benchmarks_a_users_module_named_by_its_factory(conf_dir, tmp_path):
    out = tmp_path / "run"
    proc = _run(conf_dir, "bench.provider=factory", "bench.factory=tests.bench.user_modules:two_towers",
                "bench.batch_size=4", "bench.repeats=1", "bench.warmup=0", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = (out / "bench_two_towers.csv").read_text().splitlines()
    paths = [row.split(",")[0] for row in rows[1:]]
    assert sorted(paths) == ["model", "model.item", "model.item.0", "model.user", "model.user.0", "model.user.1",
                             "model.user.2"], paths
    assert rows[1].startswith("model,TwoTowers,0,ok,")  # the whole module ran on the factory's two inputs


@pytest.mark.parametrize("spec, needle", [
    ("tests.bench.user_modules", "expected module:function"),
    ("tests.bench.no_such_module:f", "cannot import 'tests.bench.no_such_module' (ModuleNotFoundError"),
    ("tests.bench.user_modules:missing", "has no attribute 'missing'"),
    ("tests.bench.user_modules:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function(batch_size)"),
    ("tests.bench.user_modules:raises", "failed: RuntimeError: no GPU here"),
    ("tests.bench.user_modules:returns_a_module", "returned Linear, expected (module, input)"),
])
def test_cli_a_bad_factory_is_one_line_exit_2_and_writes_nothing(conf_dir, tmp_path, spec, needle):
    out = tmp_path / "run"
    proc = _run(conf_dir, "bench.provider=factory", f"bench.factory={spec}", f"hydra.run.dir={out}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: bench.factory") and needle in line, line
    assert not out.exists()


def test_cli_a_model_whose_forward_raises_is_one_line_exit_2_and_writes_nothing(conf_dir, tmp_path):
    out = tmp_path / "run"
    proc = _run(conf_dir, "bench.provider=factory", "bench.factory=tests.bench.user_modules:forward_raises",
                f"hydra.run.dir={out}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: the model's forward failed on the provider's input"), line
    assert "RuntimeError: shape" in line
    assert not out.exists()


@pytest.mark.parametrize("overrides, line", [
    (["bench.factory=tests.bench.user_modules:two_towers"],
     "bench.factory=tests.bench.user_modules:two_towers is read only with bench.provider=factory, not "
     "bench.provider=zoo; add bench.provider=factory"),
    (["bench.example=mlp_tree"],
     "bench.example=mlp_tree is read only with bench.provider=example, not bench.provider=zoo; "
     "add bench.provider=example"),
    (["bench.provider=example", "bench.loka_mods=true"],
     "bench.loka_mods=True is read only with bench.provider=zoo, not bench.provider=example; "
     "add bench.provider=zoo"),
])
def test_cli_a_setting_of_another_provider_is_one_line(conf_dir, tmp_path, overrides, line):
    out = tmp_path / "run"
    proc = _run(conf_dir, *overrides, f"hydra.run.dir={out}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: {line}"]
    assert not out.exists()


def test_cli_rerun_moves_the_earlier_runs_traces_and_tables_aside(conf_dir, tmp_path):
    out = tmp_path / "run"
    (out / "traces" / "model.gone").mkdir(parents=True)
    (out / "traces" / "model.gone" / "old.pt.trace.json").write_text("{}")
    (out / "bench_mlp_tree.csv").write_text("old\n")
    proc = _run(conf_dir, "bench.provider=example", "bench.example=mlp_tree", "bench.depth=1", "bench.trace=true",
                "bench.repeats=1", "bench.warmup=0", "bench.results=[csv]", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    [dest] = (out / "previous").iterdir()
    assert f"the earlier run's outputs (traces, bench_mlp_tree.csv) were moved to {dest}" in proc.stderr
    assert (dest / "traces" / "model.gone" / "old.pt.trace.json").is_file()
    assert (dest / "bench_mlp_tree.csv").read_text() == "old\n"
    assert sorted(p.name for p in (out / "traces").iterdir()) == ["model", "model.head", "model.left", "model.right"]
    assert (out / "bench_mlp_tree.csv").read_text().startswith("component_name,")


def test_cli_a_rerun_that_fails_leaves_the_earlier_runs_outputs_where_they_were(conf_dir, tmp_path):
    out = tmp_path / "run"
    (out / "traces" / "model.0").mkdir(parents=True)
    (out / "traces" / "model.0" / "old.pt.trace.json").write_text("{}")
    (out / "bench_mlp_tree.csv").write_text("good\n")
    proc = _run(conf_dir, "bench.provider=factory", "bench.factory=tests.bench.user_modules:forward_raises",
                f"hydra.run.dir={out}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: the model's forward failed on the provider's input"), line
    assert (out / "bench_mlp_tree.csv").read_text() == "good\n"
    assert (out / "traces" / "model.0" / "old.pt.trace.json").read_text() == "{}"
    assert sorted(p.name for p in out.iterdir()) == ["bench_mlp_tree.csv", "traces"]
