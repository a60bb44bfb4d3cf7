"""Shared test settings."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Tests run many tiny ops: one intra-op thread avoids OpenMP spin contention on the 2-core CI machine
    (measured 10-100x slower per op with 2 threads under load); restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than ~10 s (deselect with -m 'not slow')")
