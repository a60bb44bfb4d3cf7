"""Bad benchmark settings are refused when the options are built, before any model runs or file is written:
one ValueError naming the field and its valid values (the command line turns it into one ``error:`` line)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from loka_trainer.bench import BenchOptions, ExampleProvider, ModuleProvider, run_bench, write_results
from loka_trainer.bench.examples import MLPTree
from loka_trainer.bench import runner


@pytest.mark.parametrize("field, value, needle", [
    ("results", ("pdf",), "bench.results='pdf' is unknown; valid values: ['csv', 'icicle', 'json', 'markdown'"),
    ("results", "csv", "bench.results: must be a list of strings, got str 'csv' (a list: ['csv'])"),
    ("timer", "bogus", "bench.timer='bogus' is unknown; valid values: ['auto', 'cuda_events', 'do_bench', 'wall']"),
    ("profilers", ("bogus",), "bench.profilers='bogus' is unknown; valid values: ['bandwidth', 'flops'"),
    ("replicate", 0, "bench.replicate must be >= 1, got 0"),
    ("device", "gpu", "bench.device='gpu' is unknown; valid values: auto, cpu, cuda, cuda:N"),
    ("batch_size", -3, "bench.batch_size must be >= 0, got -3"),
    ("depth", "abc", "bench.depth: must be an integer, got str 'abc'"),
    ("include", "model.left*", "bench.include: must be a list of strings, got str 'model.left*'"),
    ("trace", "yes", "bench.trace: must be True or False, got str 'yes'"),
    ("root_name", "my.model", "bench.root_name='my.model': must be a non-empty name without '.'"),
    ("root_name", "", "bench.root_name='': must be a non-empty name without '.'"),
])
def test_a_bad_setting_is_one_value_error_naming_the_field(field, value, needle):
    with pytest.raises(ValueError) as err:
        BenchOptions(**{field: value})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_list_settings_take_a_list_or_a_tuple():
    assert BenchOptions(results=["csv"], include=["model.a*"]).results == ("csv",)
    assert BenchOptions.from_mapping({"profilers": ["params"]}).profilers == ("params",)


def test_cuda_on_a_machine_without_it_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="bench.device='cuda': CUDA is not available on this machine"):
        runner.resolve_device("cuda")
    assert runner.resolve_device("auto") == torch.device("cpu")


def test_an_include_glob_matching_nothing_names_the_closest_paths():
    with pytest.raises(ValueError, match=r"bench.include: \['model.lfet\*'\] match\(es\) no submodule down to "
                                         r"bench.depth=3; closest of its 9 paths: \['model.left'"):
        runner.check_filters(MLPTree(), BenchOptions(include=("model.lfet*",)))
    with pytest.raises(ValueError, match=r"bench.exclude: \['model.rigth'\].*closest.*'model.right'"):
        runner.check_filters(MLPTree(), BenchOptions(exclude=("model.rigth",)))
    runner.check_filters(MLPTree(), BenchOptions(include=("model.left*",), exclude=("model.right",)))


def test_an_include_naming_only_a_module_list_says_to_name_its_entries():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    with pytest.raises(ValueError, match=r"bench.include: \['model.layers'\] name\(s\) only a ModuleList / "
                                         r"ModuleDict, which is never called itself; name its entries, e.g. "
                                         r"'model.layers.\*'"):
        runner.check_filters(Stack(), BenchOptions(include=("model.layers",)))
    runner.check_filters(Stack(), BenchOptions(include=("model.layers*",)))


def test_an_include_naming_the_second_path_of_a_shared_module_selects_it(cpu):
    lin = nn.Linear(2, 2)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    opts = BenchOptions(include=("model.2",), warmup=0, repeats=1, progress=False, profilers=("params",))
    result = run_bench(ModuleProvider(model, torch.randn(3, 2)).get_component(cpu), opts)
    assert result.nodes["model.0"].status == "ok" and result.nodes["model.0"].metrics["param_bytes"] == 24
    assert result.nodes["model.1"].status == "estimated"


@pytest.mark.parametrize("glob", ["model", "*", "mod*"])
def test_an_exclude_matching_the_root_is_one_value_error(glob):
    with pytest.raises(ValueError, match=r"bench.exclude: \[.*\] match\(es\) the root 'model', which would drop "
                                         r"every module"):
        runner.check_filters(MLPTree(), BenchOptions(exclude=(glob,)))


def test_run_bench_refuses_an_include_that_selects_nothing(cpu):
    component = ModuleProvider(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)).get_component(cpu)
    opts = BenchOptions(include=("nomatch*",), warmup=0, repeats=1, progress=False)
    with pytest.raises(ValueError, match="none is close among its 2 paths, e.g. \\['model', 'model.0'\\]"):
        run_bench(component, opts)


@pytest.fixture(scope="module")
def small_result():
    opts = BenchOptions(depth=1, warmup=0, repeats=1, progress=False, profilers=("params",))
    return run_bench(ExampleProvider("mlp_tree", batch_size=2).get_component(torch.device("cpu")), opts)


def test_write_results_takes_a_str_folder(small_result, tmp_path):
    paths = write_results(small_result, str(tmp_path / "out"), ["csv"], stem="t")
    assert paths == [tmp_path / "out" / "t.csv"] and paths[0].is_file()


@pytest.mark.parametrize("out, names, needle", [
    ("file", ["csv"], "write_results: cannot write to {tmp}/file ({tmp}/file is not a directory)"),
    ("out", "csv", "write_results: names must be a list of result names, e.g. ['csv'], not the string 'csv'"),
    ("out", ["csv", "pdf"], "bench.results='pdf' is unknown"),
])
def test_write_results_refuses_bad_input_and_writes_nothing(small_result, tmp_path: Path, out, names, needle):
    (tmp_path / "file").write_text("keep")
    with pytest.raises(ValueError) as err:
        write_results(small_result, tmp_path / out, names)
    assert needle.format(tmp=tmp_path) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "keep"
