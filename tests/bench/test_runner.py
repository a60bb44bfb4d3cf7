from __future__ import annotations

import pytest
import torch
from torch import nn

from loka_trainer.bench import ExampleProvider, ModuleProvider, Profiler, run_bench, write_results
from loka_trainer.bench.profilers import PROFILERS


class FailsOnReplay(nn.Module):
    """Runs during input capture, then raises a CUDA OOM on every replay (as a too-big module would)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.num_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        if self.num_calls > 1:
            raise torch.cuda.OutOfMemoryError("simulated OOM")
        return self.b(self.a(x))


def test_failing_module_is_estimated_from_children_and_run_goes_on(fast_opts, cpu):
    model = nn.Sequential(FailsOnReplay(), nn.Linear(8, 2))
    result = run_bench(ModuleProvider(model, torch.randn(4, 8)).get_component(cpu), fast_opts)
    flaky, a, b = (result.nodes[p] for p in ("model.0", "model.0.a", "model.0.b"))
    assert a.status == b.status == "ok" and result.nodes["model.1"].status == "ok"
    assert flaky.status == "estimated" and "OutOfMemoryError" in flaky.error
    for key in ("latency_fwd_ms", "flops_fwd", "param_bytes"):
        assert flaky.metrics[key] == pytest.approx(a.metrics[key] + b.metrics[key])
    assert flaky.metrics["flops_fwd"] == 2 * (2 * 4 * 8 * 8)
    # The root replays the flaky module too, so it is estimated from its (partly estimated) children.
    assert result.nodes["model"].status == "estimated"


def test_failing_leaf_stays_failed_with_na(fast_opts, cpu):
    class Boom(nn.Module):
        def forward(self, x):
            if torch.is_grad_enabled() or not hasattr(self, "seen"):
                self.seen = True
                return x
            raise RuntimeError("cannot replay")

    model = nn.Sequential(nn.Linear(4, 4), Boom())
    result = run_bench(ModuleProvider(model, torch.randn(2, 4)).get_component(cpu), fast_opts)
    leaf = result.nodes["model.1"]
    assert leaf.status == "failed" and leaf.metrics.get("mfu_pct") is None
    assert result.nodes["model.0"].status == "ok"


def test_nanogpt_runs_unchanged(fast_opts, cpu):
    result = run_bench(ExampleProvider("nanogpt", batch_size=2).get_component(cpu), fast_opts)
    nodes = result.nodes
    assert {"model.wte", "model.h.0.attn", "model.h.1.mlp", "model.lm_head"} <= set(nodes)
    assert nodes["model.wte"].judged_by == "bandwidth" and nodes["model.lm_head"].judged_by == "compute"
    assert nodes["model.h"].status == "estimated"  # a ModuleList is never called itself
    assert nodes["model.lm_head"].metrics["flops_fwd"] == 2 * 2 * 32 * 32 * 128
    assert all(n.status in ("ok", "estimated") for n in nodes.values())
    assert nodes["model.h.0.attn"].metrics["flops_fwd"] > 0  # SDPA and projections counted


def test_user_profiler_plugin(fast_opts, cpu):
    class OutputNumel(Profiler):
        name = "numel"

        def profile(self, job, ctx, so_far):
            return {"out_numel": float(job.run().numel()), "saw_flops": "flops_fwd" in so_far}

    profilers = [PROFILERS["flops"](), OutputNumel()]
    result = run_bench(ModuleProvider(nn.Linear(3, 5), torch.randn(2, 3)).get_component(cpu), fast_opts,
                       profilers=profilers)
    assert result.nodes["model"].metrics["out_numel"] == 10.0 and result.nodes["model"].metrics["saw_flops"]


@pytest.mark.parametrize("timer", ["cuda_events", "do_bench"])
def test_a_cuda_timer_for_a_cpu_model_is_one_value_error(timer, cpu):
    from loka_trainer.bench import BenchOptions

    component = ModuleProvider(nn.Linear(4, 4), torch.randn(2, 4)).get_component(cpu)
    with pytest.raises(ValueError, match=f"bench.timer='{timer}' times CUDA work, but the model runs on cpu"):
        run_bench(component, BenchOptions(timer=timer, progress=False))


def test_the_cli_options_refuse_a_cuda_timer_on_the_cpu():
    from omegaconf import OmegaConf

    from loka_trainer.bench.__main__ import bench_options

    with pytest.raises(ValueError, match="bench.timer='cuda_events' times CUDA work"):
        bench_options(OmegaConf.create({"bench": {"device": "cpu", "timer": "cuda_events"}}))


def test_a_model_whose_forward_raises_is_one_value_error_with_its_cause(fast_opts, cpu):
    class Broken(nn.Module):
        def forward(self, x):
            raise KeyError("dense_features")

    with pytest.raises(ValueError, match="forward failed on the provider's input.*KeyError: 'dense_features'") as err:
        run_bench(ModuleProvider(Broken(), torch.randn(2, 4)).get_component(cpu), fast_opts)
    assert isinstance(err.value.__cause__, KeyError)


def test_traces_go_to_an_out_dir_given_as_a_string(fast_opts, cpu, tmp_path):
    import dataclasses

    opts = dataclasses.replace(fast_opts, trace=True, depth=1)
    component = ModuleProvider(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)).get_component(cpu)
    result = run_bench(component, opts, out_dir=str(tmp_path))
    assert all(n.status == "ok" for n in result.bfs()), [n.error for n in result.bfs()]
    assert list((tmp_path / "traces" / "model.0").glob("*.pt.trace.json"))


def test_a_second_run_into_the_same_out_dir_sets_the_first_runs_traces_aside(fast_opts, cpu, tmp_path):
    import dataclasses

    opts = dataclasses.replace(fast_opts, trace=True, depth=1)
    component = ModuleProvider(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)).get_component(cpu)
    lines: list[str] = []
    write_results(run_bench(component, opts, out_dir=tmp_path, log=lines.append), tmp_path, ["csv", "icicle"])
    [first] = (tmp_path / "traces" / "model.0").glob("*.pt.trace.json")
    assert lines == [] and not (tmp_path / "previous").exists()
    run_bench(component, opts, out_dir=tmp_path, log=lines.append)
    [dest] = (tmp_path / "previous").iterdir()
    assert lines == [f"the earlier run's outputs (traces, bench.csv, bench_icicle.html) were moved to {dest}"]
    assert (dest / "bench.csv").is_file() and not (tmp_path / "bench.csv").exists()
    assert [p.name for p in (tmp_path / "traces" / "model.0").glob("*.pt.trace.json")] != [first.name]
    assert len(list((tmp_path / "traces" / "model.0").glob("*.pt.trace.json"))) == 1  # this run's trace only
    assert (dest / "traces" / "model.0" / first.name).is_file()


def test_a_run_that_fails_leaves_the_earlier_runs_outputs_in_the_out_dir(fast_opts, cpu, tmp_path):
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("broken")

    (tmp_path / "traces" / "model.0").mkdir(parents=True)
    (tmp_path / "bench.csv").write_text("good\n")
    with pytest.raises(ValueError, match="forward failed"):
        run_bench(ModuleProvider(Broken(), torch.randn(2, 4)).get_component(cpu), fast_opts, out_dir=tmp_path)
    assert (tmp_path / "bench.csv").read_text() == "good\n" and (tmp_path / "traces" / "model.0").is_dir()
    assert not (tmp_path / "previous").exists()


def test_memory_snapshots_off_cuda_leave_no_empty_folders(fast_opts, cpu, tmp_path):
    import dataclasses

    opts = dataclasses.replace(fast_opts, memory_snapshot=True, depth=1)
    component = ModuleProvider(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)).get_component(cpu)
    result = run_bench(component, opts, out_dir=tmp_path)
    assert result.nodes["model.0"].metrics["memory_snapshot"] is None
    assert not (tmp_path / "memory_snapshots").exists()


def test_a_failing_profiler_blanks_only_its_own_columns(fast_opts, cpu, monkeypatch):
    def out_of_memory(self, job, ctx, so_far):
        raise torch.cuda.OutOfMemoryError("simulated OOM\nsecond line")

    monkeypatch.setattr(PROFILERS["memory"], "profile", out_of_memory)
    monkeypatch.setattr(PROFILERS["flops"], "profile", out_of_memory)
    component = ModuleProvider(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)).get_component(cpu)
    result = run_bench(component, fast_opts)  # memory runs between latency_fwd_bwd and bandwidth
    leaf = result.nodes["model.0"]
    for key in ("param_bytes", "latency_fwd_ms", "latency_fwd_bwd_ms", "bytes_moved"):
        assert leaf.metrics.get(key), key
    assert leaf.status == "failed" and leaf.error == "flops, memory: OutOfMemoryError: simulated OOM"
    assert leaf.metrics.get("flops_fwd") is None and leaf.metrics.get("peak_mem_bytes") is None
    from loka_trainer.bench.table import row

    assert row(leaf)["notes"].startswith("flops, memory: OutOfMemoryError: simulated OOM")
    assert row(leaf)["est_bytes_moved_mb"] is not None
    root = result.nodes["model"]  # its child has no FLOPs either: nothing to estimate them from
    assert root.status == "failed" and root.metrics["latency_fwd_ms"] > 0 and root.metrics.get("flops_fwd") is None
