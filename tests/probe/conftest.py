"""Probe tests run many tiny linear-algebra ops: one intra-op thread avoids OpenMP spin contention on the
2-core CI machine (measured 100x slower per op with 2 threads under load), and is restored afterwards."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
