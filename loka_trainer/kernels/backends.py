"""The registry of GEMM backends Dispatch chooses from; the probe's report imports it too.

``BACKENDS`` holds every backend this package knows (constructing one imports nothing optional);
``available_backends(device)`` keeps those that can run there — a missing library or an unsupported
device makes a backend "not a candidate", never an error. See ``backend_base.GemmBackend`` for the
interface: ``name``, ``is_available(device)``, ``supports(M, K, N)``, ``forward(x (M,K), w (N,K)) -> (M,N)``,
``input_grad(dy (M,N), w (N,K)) -> (M,K)``, ``weight_grad(dy (M,N), x (M,K)) -> (N,K)``.
"""
from __future__ import annotations

import torch

from loka_trainer.kernels.backend_base import BF16Backend, GemmBackend
from loka_trainer.kernels.backends_fbgemm import fbgemm_backends
from loka_trainer.kernels.backends_scaled_mm import scaled_mm_backends
from loka_trainer.kernels.backends_torchao import torchao_backends
from loka_trainer.kernels.backends_triton import triton_backends

BASELINE = "bf16"

BACKENDS: dict[str, GemmBackend] = {
    BASELINE: BF16Backend(),
    **scaled_mm_backends(),
    **torchao_backends(),
    **fbgemm_backends(),
    **triton_backends(),
}


def get_backend(name: str) -> GemmBackend:
    """Backend by name; unknown name -> ValueError listing the valid ones."""
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; valid: {sorted(BACKENDS)}")
    return BACKENDS[name]


def available_backends(device: torch.device | str) -> dict[str, GemmBackend]:
    """The backends that can run on ``device`` (always includes ``bf16``), in registry order."""
    return {name: b for name, b in BACKENDS.items() if b.is_available(device)}
