"""The GPU benchmark scripts' multi-rank path, run on CPU with gloo (times are meaningless there)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", sorted(f"{p.parent.name}.{p.stem}" for folder in ("scripts", "benchmarks")
                                          for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"))
def test_every_script_and_benchmark_imports_as_a_module_without_running(module):
    # what `python -m scripts.<name>` / `python -m benchmarks.<name>` resolve first: the package's current module
    # paths and the sibling modules; importing starts no measurement (no CUDA here: any GPU work would raise)
    mod = importlib.import_module(module)
    assert callable(getattr(mod, "main", None)) or module in {"scripts.bench_targets", "scripts.bench_timing",
                                                              "scripts.mods_layer_variants", "scripts.train_runs",
                                                              "scripts.run_queue", "scripts.kernel_split",
                                                              "scripts.provenance", "scripts.result_files"}


@pytest.mark.slow
def test_fsdp2_bench_runs_two_ranks_and_reports_every_variant(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "scripts.bench_fsdp2_gpu", str(tmp_path), "--device", "cpu", "--no-compile",
           "--model", "dlrm", "--batch", "32", "--vocab", "50", "--steps", "1", "--warmup", "1",
           "--precisions", "bf16", "loka"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.loads((tmp_path / "bench_fsdp2.json").read_text())
    rows = {r["precision"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "loka"}
    assert all(r["step_ms"] > 0 and r["examples_per_s"] > 0 for r in rows.values()), rows
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert any("GEMMs in FP8" in line for line in rows["loka"]["log"])  # the plan was built and broadcast
    assert result["meta"]["gpus"] == 2 and "replicated" in result["meta"]["embeddings"]
    assert "loka" in proc.stdout.splitlines()[-1]  # the table is printed last


@pytest.mark.slow
def test_mods_stack_bench_builds_and_steps_every_variant():
    cmd = [sys.executable, "-m", "benchmarks.bench_mods_stack_gpu", "unused", "--device", "cpu",
           "--widths", "256", "512", "256", "--batch", "32"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == [
        "base", "fused_bf16", "split_bf16", "fused_fp8", "split_fp8", "split_fp8_handoff"]


def test_mods_stack_variants_have_the_layers_they_claim():
    from benchmarks.bench_mods_stack_gpu import build_variants
    from loka_trainer.mods.module import FusedLinearMods
    v = build_variants([256, 512, 256], "cpu", compile_=False)
    fused = {name: [m for m in v[name].modules() if isinstance(m, FusedLinearMods)] for name in v}
    assert fused["base"] == [] and len(fused["fused_bf16"]) == 2
    assert [m.mode for m in fused["fused_bf16"] + fused["split_bf16"]] == ["fused_bf16"] * 2 + ["split_bf16"] * 2
    assert all(m.mode == "fused_fp8" and m.dgrad == "scaled_mm_rowwise" for m in fused["fused_fp8"])
    assert [m.emit_fp8 for m in fused["fused_fp8"]] == [False, False]
    assert all(m.mode == "split_fp8" for m in fused["split_fp8"] + fused["split_fp8_handoff"])
    # the first feeds the second
    assert [m.emit_fp8 for m in fused["split_fp8"] + fused["split_fp8_handoff"]] == [False, False, True, False]


def _quality_json(path: Path) -> Path:
    runs = []
    for seed in (0, 1):
        for precision, shift in (("bf16", 0.0), ("loka", 0.01)):
            train = [[s, 0.7 - 0.001 * s + shift] for s in range(0, 100, 5)]
            runs.append({"model": "wukong", "precision": precision, "seed": seed, "train": train,
                         "eval": {"eval_logloss": 0.5 + shift + 0.001 * seed, "eval_ne": 0.9, "eval_auc": 0.7},
                         "examples_per_s": 1000.0})
    path.mkdir(parents=True)
    (path / "quality.json").write_text(json.dumps({"runs": runs}))
    return path / "quality.json"


@pytest.mark.slow
def test_plot_results_redraws_from_json_and_rejects_unknown_files(tmp_path):
    quality = _quality_json(tmp_path / "q")
    e2e = tmp_path / "e" / "bench_e2e.json"
    e2e.parent.mkdir()
    row = dict(model="wukong", batch=64, train_step_ms=2.0, infer_step_ms=1.0, train_gemm_ms=0.5, train_other_ms=1.0,
               train_attention_ms=0.25)
    e2e.write_text(json.dumps({"rows": [{**row, "precision": "bf16"}, {**row, "precision": "loka"}]}))
    fsdp2 = tmp_path / "f" / "bench_fsdp2.json"
    fsdp2.parent.mkdir()
    meta = {"model": "wukong", "gpus": 2, "device": "cpu", "per_gpu_batch": 64}
    fsdp2.write_text(json.dumps({"meta": meta, "rows": [
        {"precision": "bf16", "step_ms": 2.0, "examples_per_s": 64.0e3},
        {"precision": "loka", "step_ms": 1.6, "examples_per_s": 80.0e3}, {"precision": "x", "status": "error"}]}))
    script = ["-m", "scripts.plot_results"]
    proc = subprocess.run([sys.executable, *script, str(quality), str(e2e), str(fsdp2)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (quality.parent / "quality_rll.png").stat().st_size > 0 and (e2e.parent / "bench_e2e.png").is_file()
    assert (fsdp2.parent / "bench_fsdp2.png").stat().st_size > 0
    assert "| wukong | loka | 2 |" in proc.stdout  # the RLL table, both seeds
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, *script, str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no plot for a file named 'other.json'" in proc.stderr
    damaged = tmp_path / "d" / "quality.json"  # a write cut short: named in one line, no traceback
    damaged.parent.mkdir()
    damaged.write_text('{"runs": [')
    proc = subprocess.run([sys.executable, *script, str(quality), str(damaged)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and f"error: {damaged}: not a readable quality.json (JSONDecodeError" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_e2e_table_shows_the_training_peak_memory_and_n_a_for_rows_without_it():
    from scripts.bench_e2e_gpu import table
    row = dict(model="wukong", batch=64, train_step_ms=2.0, infer_step_ms=1.0, train_gemm_ms=0.5, train_other_ms=1.0)
    lines = table([{**row, "precision": "bf16", "train_peak_mem_gib": 21.5}, {**row, "precision": "loka"}])
    assert lines.splitlines()[0].endswith("peak GiB")
    assert lines.splitlines()[1].endswith("21.50") and lines.splitlines()[2].endswith("n/a")


@pytest.mark.parametrize("returncode, rows", [(0, 1), (1, 1), (0, 0), (0, None)])
def test_e2e_variant_runs_in_a_process_of_its_own_and_returns_its_row(tmp_path, returncode, rows):
    """By default each variant is measured by a process of its own (nothing left allocated by another variant),
    with the parent's settings and plan folder; its one row comes back, or a row saying why not."""
    import argparse
    from scripts.bench_e2e_gpu import measure_in_process_of_its_own
    args = argparse.Namespace(out=tmp_path, batch=8192, vocab=1000, steps=10, warmup=3, no_compile=False,
                              compile_mode=None, plans_dir=None)
    seen = []
    row = {"model": "wukong_h200", "precision": "loka+graph_timed", "train_step_ms": 50.0}
    stale = tmp_path / "variants" / "wukong_h200_loka_graph_timed" / "bench_e2e.json"  # an earlier run's
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"meta": {}, "rows": [{**row, "train_step_ms": 99.0}]}))

    def run(cmd, cwd):  # rows None: the process wrote nothing
        seen.append(cmd)
        out = Path(cmd[cmd.index("scripts.bench_e2e_gpu") + 1])
        if rows is not None:
            (out / "bench_e2e.json").write_text(json.dumps({"meta": {}, "rows": [row] * rows}))
        return subprocess.CompletedProcess(cmd, returncode)
    got = measure_in_process_of_its_own("wukong_h200", "loka+graph_timed", args, run=run)
    [cmd] = seen
    assert cmd[cmd.index("scripts.bench_e2e_gpu") + 1] == str(tmp_path / "variants" / "wukong_h200_loka_graph_timed")
    assert cmd[cmd.index("--precisions") + 1] == "loka+graph_timed" and "--in-process" in cmd
    assert cmd[cmd.index("--plans-dir") + 1] == str(tmp_path / "plans") and cmd[cmd.index("--batch") + 1] == "8192"
    if returncode == 0 and rows == 1:
        assert got["train_step_ms"] == 50.0
    else:
        assert "train_step_ms" not in got and got["status"].startswith(f"error: its process exited with {returncode}")
        assert not stale.exists() or rows is not None


def test_e2e_precision_variants_apply_their_suffixes_and_reject_unknown_ones():
    from scripts.bench_e2e_gpu import precision_config
    assert precision_config("loka").gpu_timer == "cuda_events"
    timed = precision_config("loka+graph_timed")
    assert timed.gpu_timer == "cuda_graph" and timed.dispatch and timed.mods
    both = precision_config("bf16+mods+graph_timed")
    assert both.mods and not both.dispatch and both.gpu_timer == "cuda_graph"
    assert precision_config("loka").keep_declared_bf16 and not precision_config("loka+all_targets").keep_declared_bf16
    with pytest.raises(SystemExit, match="unknown suffix \\['turbo'\\]"):
        precision_config("loka+turbo")


@pytest.mark.slow
def test_e2e_bench_rejects_bad_names_before_touching_a_device():
    cmd = [sys.executable, "-m", "scripts.bench_e2e_gpu", "unused", "--models", "wukong",
           "--precisions", "bf16", "loka+turbo"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown suffix ['turbo']" in proc.stderr
    assert "needs a CUDA GPU" not in proc.stderr


def test_dispatch_bench_fused_variants_run_forward_and_backward_on_cpu():
    # every fused Mods layer variant names a real forward mode and backends (torch's FP8 GEMM runs on CPU)
    from loka_trainer.mods.ops import linear_mods
    from scripts.mods_layer_variants import FUSED_VARIANTS, SERIAL_GRADS_VARIANTS
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(256, 64) / 8).to(torch.bfloat16).requires_grad_()
    for name, kw in FUSED_VARIANTS.items():
        x.grad = w.grad = None
        linear_mods(x, w, **kw).float().square().sum().backward()
        assert torch.isfinite(x.grad.float()).all() and torch.isfinite(w.grad.float()).all(), name
        assert x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0, name
    assert set(SERIAL_GRADS_VARIANTS) <= set(FUSED_VARIANTS)


def test_mods_layer_gemm_bench_covers_a_linears_three_gemms_and_reports_their_ratio(tmp_path):
    from benchmarks.bench_mods_layer_gemms_gpu import GEMM_RECIPES, gemm_dims, plot, summarize

    M, K, N = 32, 48, 16
    x, w, dy = torch.randn(M, K), torch.randn(N, K), torch.randn(M, N)
    operands = {"forward": (x, w), "input_grad": (dy, w.t()), "weight_grad": (dy.t(), x.t())}  # a (R, C), b (P, C)
    expected = {"forward": x @ w.t(), "input_grad": dy @ w, "weight_grad": dy.t() @ x}
    for gemm, (R, C, P) in gemm_dims(M, K, N).items():
        a, b = operands[gemm]
        assert (a.shape, b.shape) == ((R, C), (P, C)), gemm
        torch.testing.assert_close(a @ b.t(), expected[gemm])
    # bf16 sums to 30 us, rowwise to 20 us: the rowwise line reports 1.50x; a missing recipe reports nan
    rows = [{"K": K, "N": N, "kind": "gemm", "op": op, "recipe": recipe, "graph_us": t}
            for op in gemm_dims(M, K, N) for recipe, t in (("bf16", 10.0), ("rowwise", 20 / 3))]
    lines = summarize(rows)
    assert any(" rowwise " in ln and ln.rstrip().endswith("1.50x") for ln in lines), lines
    assert any(" tw_e4m3 " in ln and ln.rstrip().endswith("nanx") for ln in lines), lines
    assert set(GEMM_RECIPES) == {"bf16", "tw_e4m3", "tw_e5m2", "rowwise"}
    plot(rows, tmp_path / "g.png", "cpu")
    assert (tmp_path / "g.png").stat().st_size > 0


def test_dispatch_bench_forward_only_suite_gets_its_own_best_and_ratios():
    from scripts.bench_dispatch_gpu import _inference, add_fused_best, add_ratios

    row = lambda suite, variant, us: {"suite": suite, "M": 1024, "K": 256, "N": 256, "variant": variant,  # noqa: E731
                                      "graph_us": us, "wall_s": 2.0}
    rows = [row("mods_layer", "base_eager", 30.0), row("mods_layer", "split_bf16", 15.0),
            row("mods_layer", "fused_bf16", 20.0),
            row("mods_layer_fwd", "base_eager", 12.0), row("mods_layer_fwd", "split_bf16", 8.0),
            row("mods_layer_fwd", "fused_bf16", 4.0)]
    add_fused_best(rows)
    add_ratios(rows, {"mods_layer": "base_eager", "mods_layer_fwd": "base_eager"})
    best = {r["suite"]: r for r in rows if r["variant"] == "fused_best"}
    assert best["mods_layer"]["picked"] == "split_bf16" and best["mods_layer"]["speedup"] == 2.0
    assert best["mods_layer_fwd"]["picked"] == "fused_bf16" and best["mods_layer_fwd"]["speedup"] == 3.0
    assert sum(r.get("wall_s", 0) for r in rows) == 12.0  # the picked rows' wall seconds are not counted twice
    w = torch.ones(4, 4, requires_grad=True)
    y = _inference(lambda x: x @ w, torch.ones(2, 4))()
    assert y.grad_fn is None and torch.equal(y, torch.full((2, 4), 4.0))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the fused kernels' autotune list needs triton")
def test_fused_forward_bench_sweeps_the_autotune_list_and_finds_the_fastest_config(tmp_path):
    from benchmarks.bench_fused_forward_gpu import autotune_list, best_configs, config_grid, config_table, plot_configs

    for stages in [(3, 4), (2,)]:
        grid = {tuple(c.values()) for c in config_grid(stages)}
        assert autotune_list() <= grid and (128, 64, 4, stages[0]) in grid
    row = lambda listed, us, bm: {"part": "configs", "K": 64, "N": 256, "fp8": True, "BLOCK_M": bm,  # noqa: E731
                                  "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, "autotune_list": listed,
                                  "graph_us": us}
    failed = {k: v for k, v in row(False, 1.0, 64).items() if k != "graph_us"} | {"error": "out of resources"}
    rows = [row(True, 9.0, 16), row(True, 7.0, 32), row(False, 5.0, 128), failed]  # failed: never picked
    best_listed, best = best_configs(rows, 64, 256, True)
    assert (best_listed["BLOCK_M"], best["BLOCK_M"]) == (32, 128)
    assert config_table(rows)[1].split()[-1] == "5.0"
    plot_configs(rows, tmp_path / "c.png", "cpu")
    assert (tmp_path / "c.png").stat().st_size > 0


@pytest.mark.slow
def test_dispatch_bench_variant_names_default_all_and_unknown():
    from scripts.mods_layer_variants import (
        ALL_MODS_LAYER_VARIANTS, DEFAULT_MODS_LAYER_VARIANTS, mods_layer_variant_names,
    )

    assert mods_layer_variant_names(None) == mods_layer_variant_names("default") == DEFAULT_MODS_LAYER_VARIANTS
    assert set(DEFAULT_MODS_LAYER_VARIANTS) < set(ALL_MODS_LAYER_VARIANTS) == set(mods_layer_variant_names("all"))
    assert mods_layer_variant_names("split_bf16,base_eager") == ("split_bf16", "base_eager")
    with pytest.raises(ValueError, match=r"\['splitbf16'\]"):
        mods_layer_variant_names("base_eager,splitbf16")
    # the script refuses it before looking for a GPU
    proc = subprocess.run([sys.executable, "-m", "scripts.bench_dispatch_gpu", "unused",
                           "--mods-layer-variants", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown Mods layer variant(s) ['nope']" in proc.stderr
    assert "needs a CUDA GPU" not in proc.stderr


def test_bench_targets_take_the_fastest_reference_per_shape_and_the_geomean():
    from scripts.bench_targets import TARGETS, Target, target_lines, target_ratio

    row = lambda suite, variant, us, K=256: {"suite": suite, "M": 1024, "K": K, "N": 256,  # noqa: E731
                                             "variant": variant, "graph_us": us}
    # shape 1: 40 / 10 = 4x, shape 2: 30 / 30 = 1x -> geomean 2x; a shape without the variant is left out
    rows = [row("mods_layer", "base_eager", 40.0), row("mods_layer", "fused_best", 10.0),
            row("mods_layer", "base_eager", 30.0, K=512), row("mods_layer", "fused_best", 30.0, K=512),
            row("mods_layer", "base_eager", 30.0, K=1024)]
    t = Target("mods_layer", "fused_best", ("base_eager",), 2.0, "x")
    assert target_ratio(rows, t) == (pytest.approx(2.0), 2)
    assert target_lines(rows, [t])[0].endswith(": MET")
    strict = Target("mods_layer", "fused_best", ("base_eager",), 2.0, "x", strictly=True)
    assert target_lines(rows, [strict])[0].endswith("NOT MET")
    # the fastest of several references: 100 (tensorwise) beats 120 -> 100 / 90
    wk = [row("wukong", "torchao_tensorwise_compiled", 100.0), row("wukong", "torchao_rowwise_compiled", 120.0),
          row("wukong", "bf16_compiled", 99.0), row("wukong", "loka_compiled", 90.0)]
    lines = target_lines(wk)  # only the two Wukong targets: no Mods layer rows
    assert len(lines) == 2 and "1.11x over 1 shape(s) (needs >= 1.05x): MET" in lines[0]
    assert "1.10x" in lines[1] and lines[1].endswith("NOT MET")
    assert {t.suite for t in TARGETS} == {"mods_layer", "wukong"}


def test_layer_timer_bench_parses_shapes_summarizes_spread_and_plots(tmp_path):
    from benchmarks.bench_layer_timer_gpu import DEFAULT_SHAPES, parse_shape, plot, spread

    assert parse_shape("4096x720x512:fused_bf16") == (4096, 720, 512, "fused_bf16")
    assert parse_shape("8x16x256") == (8, 16, 256, "split_bf16")
    assert [parse_shape(s)[3] for s in DEFAULT_SHAPES] == ["fused_bf16", "fused_bf16", "split_bf16"]
    assert spread([3.0, 1.0, 2.0, 1.5]) == {"min": 1.0, "median": 2.0, "max": 3.0, "spread": 2.0}
    runs = [{"M": 8, "K": 16, "N": 256, "timer": t, "us": {"bf16": 1.0 + i, "scaled_mm_rowwise": 2.0}}
            for t in ("cuda_events", "cuda_graph") for i in range(3)]
    plot(runs, [(8, 16, 256, "split_bf16")], tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


def test_dispatch_bench_serial_grads_variants_are_fused_variants_with_the_backward_in_order():
    from scripts.mods_layer_variants import ALL_MODS_LAYER_VARIANTS, FUSED_VARIANTS, SERIAL_GRADS, SERIAL_GRADS_VARIANTS

    assert set(SERIAL_GRADS_VARIANTS) <= set(FUSED_VARIANTS)
    assert {f"{n}_serial_grads" for n in SERIAL_GRADS_VARIANTS} <= set(ALL_MODS_LAYER_VARIANTS)
    assert SERIAL_GRADS.backward_streams is False




def test_layer_sensitivity_sees_an_amplified_layer_and_restores_the_model():
    """One FP8 layer at a time: for the same GEMM error, the layer whose output the model weighs 100x more moves
    the logits more, and every layer is back in place (same module, same logits) afterwards."""
    from torch import nn

    from scripts.fp8_layer_sensitivity import forward, sensitivity

    class Net(nn.Module):  # batch (B, 64) -> logits (B,); `quiet`'s output enters at 1/100 of `loud`'s weight
        def __init__(self):
            super().__init__()
            self.quiet, self.loud, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1)

        def forward(self, x):
            return self.head(0.01 * self.quiet(x) + self.loud(x)).squeeze(-1)

    torch.manual_seed(0)
    net, batches = Net().eval(), [torch.randn(64, 64) for _ in range(2)]
    before, modules = forward(net, batches), dict(net.named_children())
    result = sensitivity(net, batches, torch.zeros(128), {"quiet": net.quiet, "loud": net.loud}, "scaled_mm_rowwise")
    quiet, loud = result["layers"]["quiet"], result["layers"]["loud"]
    assert 0.01 < quiet["gemm_rel_err"] < 0.1 and 0.01 < loud["gemm_rel_err"] < 0.1
    assert loud["logit_rel_change"] / loud["gemm_rel_err"] > 10 * quiet["logit_rel_change"] / quiet["gemm_rel_err"]
    assert dict(net.named_children()) == modules and torch.equal(forward(net, batches), before)


def test_data_bench_times_the_train_stream_per_thread_and_worker_count_and_refuses_a_bad_config(tmp_path):
    cmd = [sys.executable, "-m", "scripts.bench_data", "--out", str(tmp_path), "--threads", "1", "2", "--workers", "1",
           "3", "--batches", "2", "--", "model=interformer", "data.batch_size=64"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "data_speed.json").read_text())
    assert [(row["threads"], row["workers"]) for row in result["rows"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert result["overrides"] == ["model=interformer", "data.batch_size=64"]
    for row in result["rows"]:
        assert row["ms_per_batch"] > 0 and row["examples_per_s"] == pytest.approx(64 / row["ms_per_batch"] * 1000)
    assert "ms per batch" in proc.stdout.splitlines()[-5]
    before = (tmp_path / "data_speed.json").read_text()
    bad = subprocess.run([*cmd[:-2], "model=no_such_model"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no_such_model" in bad.stderr + bad.stdout
    assert (tmp_path / "data_speed.json").read_text() == before  # the earlier result stays
