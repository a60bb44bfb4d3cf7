"""`init_distributed` under MASTER_ADDR/MASTER_PORT: each process group it starts in one process works."""
from __future__ import annotations

import socket
import subprocess
import sys

from tests.launch import ROOT

TWO_GROUPS = """
import torch, torch.distributed as dist
from loka_trainer.sharding.dist import init_distributed, shutdown_distributed
for _ in range(2):
    info = init_distributed("cpu")
    total = torch.ones(1)
    dist.all_reduce(total)
    print("group", info.rank, info.world_size, int(total.item()))
    shutdown_distributed(wait_for_all=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_master_addr_without_rank_starts_one_process_groups_one_after_another():
    """MASTER_ADDR/PORT set but no RANK / WORLD_SIZE (a shell that exports them, not torchrun): rank 0 of 1."""
    env = {"PATH": "/usr/bin:/bin", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "-c", TWO_GROUPS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("group")] == ["group 0 1 1"] * 2
