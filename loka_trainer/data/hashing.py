"""Counter-based randomness: seeds derived from (seed, stream, index) and hash-based per-id random vectors.

Why hashing instead of tables: the planted teacher needs a fixed random vector per (feature, id) over vocabularies
of up to ~10M ids; hashing the id gives the same vector every time without storing a table, and any batch can be
generated from its index alone (O(1) resume, disjoint rank/split streams).
"""
from __future__ import annotations

import hashlib

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# Multipliers < 2**31 so that a 32-bit value times one never overflows int64 (tensor math has no uint64).
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_GOLDEN32 = 0x9E3779B9


def derive_seed(*parts: int | str) -> int:
    """Mix integers/strings into one 63-bit seed (splitmix64 chain); different inputs -> independent seeds."""
    state = 0x243F6A8885A308D3
    for part in parts:
        value = _stable_int(part)
        state = _splitmix64((state ^ value) & _MASK64)
    return state & 0x7FFFFFFFFFFFFFFF


def _stable_int(part: int | str) -> int:
    if isinstance(part, str):
        # Python's hash() of str is salted per process: use a stable digest instead.
        return int.from_bytes(hashlib.blake2b(part.encode("utf-8"), digest_size=8).digest(), "little")
    return part & _MASK64


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (one per batch; creating one is cheap)."""
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def mix32(x: torch.Tensor) -> torch.Tensor:
    """Avalanche hash of 32-bit values. x: int64 tensor, any shape, values in [0, 2**32) -> same shape/range."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


@torch.no_grad()
def hashed_bits(ids: torch.Tensor, salt: int | torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed 32-bit random words per id. ids: (N,) int64 >= 0; salt: int or (N,) int64 (e.g. per feature).

    Returns (N, dim) int64 in [0, 2**32).
    """
    folded = (ids ^ (ids >> 32)) & _MASK32  # ids beyond 2**32 alias; vocabularies here are far smaller
    base = mix32(folded ^ (salt & _MASK32))
    base = mix32(base ^ ((salt >> 32) & _MASK32))
    offsets = (torch.arange(dim, dtype=torch.int64) * _GOLDEN32) & _MASK32  # (dim,)
    return mix32(base[:, None] ^ offsets[None, :])


@torch.no_grad()
def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32-bit words -> uniform(0, 1) float32 on a 2**-23 grid, strictly inside (0, 1). bits: (...) int64."""
    # 23 bits + 0.5 needs 24 significant bits: exact in float32. With 24 bits the top value rounds to 1.0 and
    # ndtri(1.0) = inf.
    return ((bits >> 9).float() + 0.5) * (1.0 / 2.0**23)


@torch.no_grad()
def hashed_uniform(ids: torch.Tensor, salt: int | torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed uniform(0, 1) vectors per id. ids: (N,) int64 >= 0 -> (N, dim) float32, never 0 or 1."""
    return uniform_from_bits(hashed_bits(ids, salt, dim))


@torch.no_grad()
def hashed_normal(ids: torch.Tensor, salt: int | torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed standard-normal vectors per id. ids: (N,) int64 >= 0 -> (N, dim) float32, finite (|z| < 5.3)."""
    return torch.special.ndtri(hashed_uniform(ids, salt, dim))
