"""The one place that knows about process groups: start, describe, stop.

Under torchrun the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) says everything. A plain
`python train.py` gets a one-process gloo/NCCL group so the same sharded code path runs at world size 1.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import socket

import torch
import torch.distributed as dist


_GROUPS_STARTED = itertools.count()  # default process groups this process started under torchrun


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, *, local_rank: int) -> torch.device:
    """"auto" -> this rank's GPU when CUDA is available, else CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is available")
        if local_rank >= (count := torch.cuda.device_count()):
            raise ValueError(f"local rank {local_rank} has no GPU of its own: {count} visible (one rank per GPU: "
                             f"torchrun --nproc_per_node={count} or fewer)")
        return torch.device("cuda", local_rank)
    return torch.device(device)


def launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) for a plain process."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: str = "auto") -> DistInfo:
    """Start the default process group (NCCL on CUDA, gloo on CPU) and pin this rank's device."""
    rank, world_size, local_rank = launch_env()
    dev = resolve_device(device, local_rank=local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size))
            # Keys of their own for each group this process starts: a sweep (-m) starts one per point in the same
            # processes and torchrun's store, where the previous point's keys made gloo's rendezvous hang.
            store = dist.PrefixStore(f"loka_trainer/{next(_GROUPS_STARTED)}/", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=backend)


def shutdown_distributed(*, wait_for_all: bool = False) -> None:
    """Destroy the process group. ``wait_for_all`` (the run ended normally on every rank): barrier first, since
    a rank that tears down while another still finishes its writes can abort that rank's gloo transport."""
    if dist.is_initialized():
        if wait_for_all:
            dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
