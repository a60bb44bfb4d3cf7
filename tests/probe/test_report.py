"""The offline command end to end on CPU: stats from a plain loop -> report.json / .md / .png."""
from __future__ import annotations

import json

import pytest
import torch

from loka_trainer.callbacks.probe import ProbeCallback
from loka_trainer.probe.report import main
from loka_trainer.probe.stats_io import STATS_VERSION, atomic_save, seal_stats

from .helpers import learned_layer_entry
from .test_callback_probe import run_plain_loop

KERNELS = "tests.probe.user_kernels"


@pytest.fixture(scope="module")
def stats_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "probe"
    run_plain_loop(ProbeCallback(interval=2, save_interval=100, out_dir=str(out), tensorboard=False), steps=6)
    return out


@pytest.fixture(scope="module")
def outlier_stats_dir(tmp_path_factory):
    """One 256 -> 64 layer whose activations have three outlier features (scale 40), like a trained LRM's."""
    layer = learned_layer_entry()
    out = tmp_path_factory.mktemp("outliers")
    atomic_save(seal_stats({"version": STATS_VERSION, "step": 0, "world_size": 1, "layers": {"fc": layer}}),
                out / "stats.pt")
    return out


def test_report_command_writes_the_dispatch_contract(stats_dir, capsys):
    assert main([str(stats_dir), "--num-samples", "2", "--device", "cpu", "--threshold", "0.3"]) == 0
    report = json.loads((stats_dir / "report.json").read_text())
    assert set(report) == {"version", "device", "num_samples", "threshold", "min_speedup", "zero_floor",
                           "operand_dtype", "layers"}
    assert report["version"] == 1 and report["num_samples"] == 2 and report["threshold"] == 0.3
    assert report["zero_floor"] == 0.01 and report["operand_dtype"] == "bfloat16"
    assert set(report["layers"]) == {"inner.0", "inner.2", "head"}
    layer = report["layers"]["inner.0"]
    assert layer["shape"] == {"M": 16, "K": 8, "N": 32}
    assert layer["representation"].startswith("activation:full")
    for name, c in layer["candidates"].items():
        assert set(c) == {"mere", "mere_normal", "flushed", "speedup", "unsafe", "not_worth_it"}
        assert (c["flushed"] is None) == (name == "bf16")
        assert c["unsafe"] == (c["mere"] >= 0.3)
        assert c["not_worth_it"] == (c["speedup"] is None or c["speedup"] <= report["min_speedup"])
    bf16 = layer["candidates"]["bf16"]
    # BF16 operands (the reference convention): only the output's rounding to BF16 is left, ~2^-9 relative.
    assert bf16["speedup"] == 1.0 and 0 < bf16["mere"] < 0.005
    table = (stats_dir / "report.md").read_text()
    assert "| inner.0 | 16x8x32 |" in table
    assert (stats_dir / "report.png").stat().st_size > 1000


def test_out_dir_is_created_with_its_parents(stats_dir, tmp_path, capsys):
    out = tmp_path / "new" / "nested"
    assert main([str(stats_dir), "--num-samples", "1", "--backends", "bf16", "--out-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert all(set(layer["candidates"]) == {"bf16"} for layer in report["layers"].values())
    assert (out / "report.md").is_file() and (out / "report.png").is_file()


def test_a_stats_file_given_itself_writes_the_report_next_to_it(stats_dir, capsys):
    assert main([str(stats_dir / "stats.pt"), "--num-samples", "1", "--backends", "bf16"]) == 0
    assert json.loads((stats_dir / "report.json").read_text())["layers"]


def test_zero_floor_option_reaches_the_numbers(outlier_stats_dir, tmp_path):
    meres = {}
    for floor in ("0", "0.5"):
        out = tmp_path / floor
        assert main([str(outlier_stats_dir), "--num-samples", "1", "--backends", "bf16", "--zero-floor", floor,
                     "--out-dir", str(out)]) == 0
        report = json.loads((out / "report.json").read_text())
        assert report["zero_floor"] == float(floor)
        meres[floor] = report["layers"]["fc"]["candidates"]["bf16"]["mere"]
    assert meres["0"] > meres["0.5"] > 0  # a higher floor shrinks the near-zero outputs' relative errors


def test_a_user_kernel_that_hides_on_normal_inputs_is_exposed(outlier_stats_dir, tmp_path, capsys):
    """The paper's Table V check from the command line: a kernel that saturates large activations is as good
    as an exact one on N(0, 1) inputs and far off on the learned ones."""
    args = [str(outlier_stats_dir), "--num-samples", "3", "--device", "cpu", "--backends", "bf16",
            "--kernel", f"{KERNELS}:saturating", "--kernel", f"{KERNELS}:good", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    c = json.loads((tmp_path / "report.json").read_text())["layers"]["fc"]["candidates"]
    assert set(c) == {"bf16", f"{KERNELS}:saturating", f"{KERNELS}:good"}
    bad, good = c[f"{KERNELS}:saturating"], c[f"{KERNELS}:good"]
    assert bad["mere_normal"] < 1e-6 and good["mere_normal"] < 1e-6  # normal inputs: both exact
    assert bad["mere"] > 0.2 and bad["unsafe"]  # learned inputs: the clamp shows
    assert good["mere"] < 1e-6 and not good["unsafe"]
    out = capsys.readouterr().out
    assert f"kernel {KERNELS}:saturating on fc:" in out and "UNSAFE" in out.split(f"{KERNELS}:good")[0]
    assert f"| fc | 128x256x64 |" in (tmp_path / "report.md").read_text()
    assert f"{KERNELS}:saturating" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "expected module:function"),
    ("no_such_module_xyz:f", "cannot import"),
    (f"{KERNELS}:missing", "has no attribute"),
    (f"{KERNELS}:NOT_CALLABLE", "not a callable"),
    (f"{KERNELS}:wrong_shape", "expected a tensor of shape"),
    (f"{KERNELS}:raising", "failed at"),
])
def test_a_bad_kernel_is_one_line_and_exit_2(outlier_stats_dir, tmp_path, capsys, spec, message):
    args = [str(outlier_stats_dir), "--num-samples", "1", "--backends", "bf16", "--kernel", spec,
            "--out-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --kernel") and message in err and err.count("\n") == 1
    assert not (tmp_path / "report.json").exists()


def test_bad_input_is_one_line_and_exit_2(stats_dir, tmp_path, capsys):
    (tmp_path / "stats.pt").write_bytes(b"junk")
    assert main([str(tmp_path)]) == 2
    assert "invalid probe stats file" in capsys.readouterr().err
    for args, message in (([str(stats_dir), "--backends", "no_such_kernel"], "--backends"),
                          ([str(stats_dir), "--num-samples", "0"], "--num-samples"),
                          ([str(stats_dir), "--zero-floor", "-1"], "--zero-floor"),
                          ([str(stats_dir), "--device", "nonsense"], "--device"),
                          ([str(stats_dir), "--threshold", "-1"], "--threshold"),
                          ([str(stats_dir), "--rows", "0"], "--rows"),
                          ([str(stats_dir), "--out-dir", str(tmp_path / "stats.pt")], "--out-dir"),
                          ([str(stats_dir), "--out-dir", str(tmp_path / "stats.pt" / "x")], "--out-dir"),
                          *([([str(stats_dir), "--device", "cuda"], "no CUDA device")]
                            if not torch.cuda.is_available() else [])):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_the_report_shows_what_each_backends_forward_cast_flushes(tmp_path):
    """A layer whose input has one channel at ~1e6 (its mean; the others ~1): one scale per tensor (or per row:
    every row holds that channel) sets most other inputs to zero; the report shows it per backend, beside MERE."""
    import torch

    from loka_trainer.kernels.backends import get_backend
    from loka_trainer.probe.activation import ActivationTracker
    from loka_trainer.probe.report import analyze_layer
    from loka_trainer.probe.report_render import render_markdown

    from .helpers import outlier_activations

    entry = learned_layer_entry()
    act = ActivationTracker(256)
    x = outlier_activations(4096, 256, gen=torch.Generator().manual_seed(0), outliers=())
    x[:, 7] += 1e6
    act.update(x)
    act.rows_per_call = 128
    entry["activation"] = act.state_dict()
    backends = {n: get_backend(n) for n in ("bf16", "scaled_mm_tensorwise", "scaled_mm_rowwise")}
    hot = analyze_layer(entry, backends, num_samples=2, threshold=0.2, min_speedup=1.05,
                        device=torch.device("cpu"), timing=False)["candidates"]
    normal = analyze_layer(learned_layer_entry(), backends, num_samples=2, threshold=0.2, min_speedup=1.05,
                           device=torch.device("cpu"), timing=False)["candidates"]
    assert hot["bf16"]["flushed"] is None
    assert hot["scaled_mm_tensorwise"]["flushed"] > 0.5 and hot["scaled_mm_rowwise"]["flushed"] > 0.5
    assert normal["scaled_mm_tensorwise"]["flushed"] < 0.01
    report = {"device": "cpu", "num_samples": 2, "threshold": 0.2, "min_speedup": 1.05, "zero_floor": 0.01,
              "operand_dtype": "bfloat16", "layers": {"fc": {"shape": {"M": 128, "K": 256, "N": 64},
                                                             "representation": "full", "candidates": hot}}}
    row = next(line for line in render_markdown(report).splitlines() if "| scaled_mm_tensorwise |" in line)
    assert f"| {hot['scaled_mm_tensorwise']['flushed']:.4f} |" in row


def test_the_plot_gives_each_backend_one_colour_in_both_panels():
    import matplotlib.pyplot as plt

    from loka_trainer.probe.report_render import render_figure
    names = [f"backend_{i}" for i in range(7)]  # more than the 5 the hatched bars once left distinct colours for
    layer = {"candidates": {n: {"mere": 0.1, "mere_normal": 0.1, "speedup": 1.0} for n in names}}
    fig = render_figure({"layers": {"a": layer, "b": layer}, "threshold": 0.2, "min_speedup": 1.05, "device": "cpu"})
    err, speed = fig.axes

    def colours(ax):
        return {c.get_label(): c.patches[0].get_facecolor() for c in ax.containers if c.get_label() in names}
    assert colours(err) == colours(speed) and len(set(colours(err).values())) == len(names)
    plt.close(fig)


def _report_files(out) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("report.json", "report.md", "report.png")}


def test_a_disk_that_fills_while_report_json_is_written_leaves_the_earlier_report(stats_dir, tmp_path, capsys):
    """The rewrite runs under RLIMIT_FSIZE (a file may not grow past 100 bytes: a full disk, or a quota)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "report"
    assert main([str(stats_dir), "--num-samples", "1", "--backends", "bf16", "--out-dir", str(out)]) == 0
    before = _report_files(out)
    rewrite = ("import json, resource, signal, sys\n"
               "from pathlib import Path\n"
               "from loka_trainer.probe.report import write_report\n"
               "out = Path(sys.argv[1])\n"
               "report = {**json.loads((out / 'report.json').read_text()), 'num_samples': 7}\n"
               "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               "resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
               "write_report(report, out)\n")
    proc = subprocess.run([sys.executable, "-c", rewrite, str(out)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-2000:]
    assert _report_files(out) == before
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "report.png"]  # no partial file


def test_a_plot_that_fails_while_written_leaves_the_earlier_png(stats_dir, tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure

    out = tmp_path / "report"
    assert main([str(stats_dir), "--num-samples", "1", "--backends", "bf16", "--out-dir", str(out)]) == 0
    before = _report_files(out)

    def half_written(self, target, **kwargs):
        data = b"\x89PNG\r\n\x1a\n" + b"\0" * 10
        if hasattr(target, "write"):
            target.write(data)
        else:
            with open(target, "wb") as f:
                f.write(data)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_written)
    assert main([str(stats_dir), "--num-samples", "2", "--backends", "bf16", "--out-dir", str(out)]) == 2
    assert "cannot write the report" in capsys.readouterr().err
    assert (out / "report.png").read_bytes() == before["report.png"]
    assert json.loads((out / "report.json").read_text())["num_samples"] == 2  # the files written before it: whole
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "report.png"]
