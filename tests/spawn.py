"""Run a test body on N CPU ranks (gloo), each in its own spawned process, with a reliable teardown."""
from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, body: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, *args)
        dist.barrier()
    except BaseException:
        # NOTE: print before tearing down: the other rank, still in a collective, aborts the process group
        # ("terminate called without an active exception") and would otherwise be the only error reported.
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
    # Reached only on success: skip interpreter teardown, which under load occasionally aborted a finished
    # rank after FSDP2 on gloo ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(body: Callable, world: int, *args) -> None:
    """Call ``body(rank, *args)`` on ``world`` gloo ranks; ``body`` must be a module-level function."""
    mp.spawn(_rank_main, args=(world, _free_port(), body, args), nprocs=world, join=True)
