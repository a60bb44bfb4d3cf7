"""Run train.py as a user would: one process, or 2 CPU ranks through torch's elastic launcher (torchrun)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.batch_size=256", "data.max_vocab_size=20000", "data.eval_batches=8", "callbacks.progress=false"]


def run_train(args: list[str], *, nproc: int = 1, timeout: int = 600, check: bool = True, cwd: Path = ROOT
              ) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    proc = subprocess.run([*launcher, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc
