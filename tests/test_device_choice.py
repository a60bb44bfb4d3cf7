"""Which device a rank trains on (``sharding.dist.resolve_device``), checked with the config before anything starts."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.sharding.dist import resolve_device


def test_auto_is_the_cpu_without_cuda_and_the_ranks_own_gpu_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", local_rank=1) == torch.device("cpu")
    with pytest.raises(ValueError, match="trainer.device=cuda but no CUDA device is available"):
        resolve_device("cuda", local_rank=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)


def test_a_rank_without_a_gpu_of_its_own_is_refused(monkeypatch):
    """torchrun --nproc_per_node=2 on one GPU: rank 1 would otherwise fail inside CUDA, after the process group."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"local rank 1 has no GPU of its own: 1 visible .*--nproc_per_node=1"):
        resolve_device("cuda", local_rank=1)
