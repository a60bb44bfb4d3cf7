"""The Component Benchmark's CUDA timers time the model's device, not the process's current one
(``bench.device=cuda:1``). CPU-only: torch.cuda's events, streams and device switch are stood in for."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from loka_trainer.timing import time_cuda_events, time_do_bench

CUDA1 = torch.device("cuda:1")


class FakeEvent:
    """A CUDA event that remembers the stream it was recorded on; each pair is 2 ms apart."""

    recorded: list = []

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        FakeEvent.recorded.append(stream)

    def elapsed_time(self, end: "FakeEvent") -> float:
        return 2.0


def test_cuda_events_are_recorded_on_the_models_devices_stream(monkeypatch):
    FakeEvent.recorded = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    calls = []
    us = time_cuda_events(lambda: calls.append(1), warmup=1, repeats=3, device=CUDA1)
    assert us == 2000.0 and len(calls) == 4
    assert FakeEvent.recorded == [("stream of", CUDA1)] * 6


def test_do_bench_runs_with_the_models_device_current(monkeypatch):
    current = [0]

    class FakeDevice:
        def __init__(self, device) -> None:
            self.idx = torch.device(device).index

        def __enter__(self) -> None:
            self.prev, current[0] = current[0], self.idx

        def __exit__(self, *exc) -> None:
            current[0] = self.prev

    seen = []

    def do_bench(fn, return_mode="mean"):
        seen.append(current[0])
        fn()
        return 0.5

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.testing", types.SimpleNamespace(do_bench=do_bench))
    assert time_do_bench(lambda: None, warmup=0, repeats=1, device=CUDA1) == pytest.approx(500.0)
    assert seen == [1] and current[0] == 0


def test_the_runner_makes_the_models_cuda_device_current():
    from loka_trainer.bench.runner import device_scope

    scope = device_scope(CUDA1)
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    with device_scope(torch.device("cpu")):  # nothing to switch
        pass
