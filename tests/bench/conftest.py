from __future__ import annotations

import pytest
import torch

from loka_trainer.bench import BenchOptions


@pytest.fixture
def fast_opts() -> BenchOptions:
    """Few repeats and no progress bar: these tests check behaviour, not speed."""
    return BenchOptions(depth=3, warmup=0, repeats=1, progress=False)


@pytest.fixture
def cpu() -> torch.device:
    return torch.device("cpu")
