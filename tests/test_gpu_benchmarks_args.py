"""The GPU benchmarks' command lines (benchmarks/component_bench_nanogpt_gpu, fast_accum_gemms,
sweep_memory_kernels): ``--help`` prints the usage, a missing or unwritable output path and a machine without CUDA
are refused with exit status 2, and nothing is written in any of these cases."""
from __future__ import annotations

import importlib

import pytest
import torch

MODULES = ["benchmarks.component_bench_nanogpt_gpu", "benchmarks.fast_accum_gemms", "benchmarks.sweep_memory_kernels"]


@pytest.fixture(autouse=True)
def _in_empty_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _exit_status(module: str, argv: list[str]) -> int:
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(argv)
    return stop.value.code


@pytest.mark.parametrize("module", MODULES)
def test_help_prints_the_usage_and_writes_nothing(module, tmp_path, capsys):
    assert _exit_status(module, ["--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {module} [-h] out_")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module", MODULES)
def test_a_missing_or_unwritable_output_path_is_an_argparse_error(module, tmp_path, capsys):
    assert _exit_status(module, []) == 2
    assert "the following arguments are required: out_" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert _exit_status(module, [str(tmp_path / "a_file" / "out")]) == 2
    assert "a_file is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("module", MODULES)
def test_no_cuda_is_one_line_exit_2_and_writes_nothing(module, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _exit_status(module, [str(tmp_path / "out" / "result.json")]) == 2
    assert capsys.readouterr().err == (f"error: python -m {module} needs a CUDA GPU and none is available on this "
                                       "machine\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module", MODULES)
def test_a_valid_command_line_runs_the_benchmark_with_that_path(module, tmp_path, monkeypatch):
    mod = importlib.import_module(module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ran = []
    monkeypatch.setattr(mod, "run", ran.append)
    mod.main([str(tmp_path / "out.json")])
    assert [str(p) for p in ran] == [str(tmp_path / "out.json")]
