"""The GPU benchmark scripts' multi-rank path, run on CPU with gloo (times are meaningless there)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fsdp2_bench_runs_two_ranks_and_reports_every_variant(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "scripts" / "bench_fsdp2_gpu.py"), str(tmp_path), "--device", "cpu", "--no-compile",
           "--model", "dlrm", "--batch", "32", "--vocab", "50", "--steps", "1", "--warmup", "1",
           "--precisions", "bf16", "loka"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "bench_fsdp2.json").read_text())
    rows = {r["precision"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "loka"}
    assert all(r["step_ms"] > 0 and r["examples_per_s"] > 0 for r in rows.values()), rows
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert any("GEMMs in FP8" in line for line in rows["loka"]["log"])  # the plan was built and broadcast
    assert result["meta"]["gpus"] == 2 and "replicated" in result["meta"]["embeddings"]
    assert "loka" in proc.stdout.splitlines()[-1]  # the table is printed last


def test_mods_stack_bench_builds_and_steps_every_variant():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_mods_stack_gpu.py"), "unused", "--device", "cpu",
           "--widths", "256", "512", "256", "--batch", "32"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == [
        "base", "fused_bf16", "fused_fp8", "fused_fp8_handoff"]


def test_mods_stack_variants_have_the_layers_they_claim():
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_mods_stack_gpu import build_variants

    from loka_trainer.kernels.fused_linear import FusedLinearMods
    v = build_variants([256, 512, 256], "cpu", compile_=False)
    fused = {name: [m for m in v[name].modules() if isinstance(m, FusedLinearMods)] for name in v}
    assert fused["base"] == [] and len(fused["fused_bf16"]) == 2
    assert all(m.mode == "fused_fp8" and m.dgrad == "scaled_mm_rowwise" for m in fused["fused_fp8"])
    assert [m.emit_fp8 for m in fused["fused_fp8"]] == [False, False]
    assert [m.emit_fp8 for m in fused["fused_fp8_handoff"]] == [True, False]  # the first feeds the second
