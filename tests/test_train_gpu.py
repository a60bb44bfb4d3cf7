"""train.py on a GPU, as users run it: each zoo model trains a few steps with sharded embeddings (TorchRec's
fused TBE), FSDP2 dense units and the trainer's default compile. Skipped without CUDA or without the CUDA
build of fbgemm-gpu (TorchRec's sharded kernels)."""
from __future__ import annotations

import importlib.util
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.launch import run_train


def _fbgemm_cuda() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("fbgemm_gpu") is None:
        return False
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    return hasattr(torch.ops.fbgemm, "split_embedding_codegen_lookup_rowwise_adagrad_function")


pytestmark = pytest.mark.skipif(not _fbgemm_cuda(), reason="needs CUDA and the CUDA build of fbgemm-gpu")

GPU_SMALL = ["trainer.device=cuda", "data.batch_size=1024", "data.eval_batches=4", "callbacks.progress=false",
             "trainer.log_interval=5", "trainer.eval_interval=0", "trainer.compile=true", "trainer.steps=20"]
RUNS = {  # name -> overrides; the zoo under LoKA as users compile it, BF16, the GPU-scale config, data workers
    "dlrm_loka": ["model=dlrm", "precision=loka", *GPU_SMALL],
    "dlrm_dcnv2_loka": ["model=dlrm_dcnv2", "precision=loka", *GPU_SMALL],
    "wukong_loka": ["model=wukong", "precision=loka", *GPU_SMALL],
    "interformer_loka": ["model=interformer", "precision=loka", *GPU_SMALL],
    "wukong_bf16": ["model=wukong", "precision=bf16", *GPU_SMALL, "callbacks.profiler.enabled=true",
                    "callbacks.profiler.start_step=15", "callbacks.profiler.num_steps=2"],
    "wukong_h200_loka": ["model=wukong_h200", "precision=loka", *GPU_SMALL, "data.batch_size=8192",
                         "trainer.steps=10"],
    # batches from forked DataLoader worker processes, pinned by its thread, in a process that holds CUDA and NCCL
    "dlrm_bf16_workers": ["model=dlrm", "precision=bf16", *GPU_SMALL, "data.workers=2"],
}


def runs_read_by(items) -> list[str]:
    """The RUNS that the collected tests read (their ``name`` parameter): ``-k dlrm`` trains only DLRM's."""
    names = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "gpu_runs" in item.fixturenames:
            names.add(callspec.params["name"])
    return sorted(names)


@pytest.fixture(scope="module")
def gpu_runs(request, tmp_path_factory):
    """The collected tests' runs, all at once (compilation is CPU-bound and the GPU has room): name -> run dir."""
    root = tmp_path_factory.mktemp("gpu_runs")
    names = runs_read_by(request.session.items)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        futures = {name: pool.submit(run_train, [*RUNS[name], f"hydra.run.dir={root / name}"], nproc=1, timeout=900,
                                     check=False) for name in names}
        procs = {name: f.result() for name, f in futures.items()}
    return {name: (root / name, proc) for name, proc in procs.items()}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trains_on_gpu_through_train_py(gpu_runs, name):
    run_dir, proc = gpu_runs[name]
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == int(
        next(a for a in RUNS[name][::-1] if a.startswith("trainer.steps=")).split("=")[1])
    assert math.isfinite(summary["eval_logloss"]) and 0.0 < summary["eval_auc"] < 1.0
    assert summary["peak_gpu_memory_gib"] > 0  # the training's allocator high-water mark on the GPU
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses and all(math.isfinite(x) for x in losses)
    assert "device cuda" in (run_dir / "train.log").read_text()
    if "loka" in name:
        assert (run_dir / "dispatch_plan.json").is_file()


@pytest.mark.parametrize("name", ["wukong_bf16"])
def test_profiled_steps_split_their_gpu_kernels(gpu_runs, name):
    """callbacks.profiler on CUDA: each profiled step's kernels, by kind, in profile.json."""
    run_dir, proc = gpu_runs[name]
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = json.loads((run_dir / "profile.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [15, 16]
    for s in steps:
        assert 0 < s["gemm_ms"] < s["gpu_ms"] and s["top_kernels"]
        assert s["gpu_ms"] < 2 * s["wall_ms"]  # one step's kernels, not the window's
        assert s["phases"]["forward"]["gpu_ms"] > 0 and s["phases"]["backward"]["gpu_ms"] > 0
