"""Streaming activation statistics of one Linear input: count, mean and scatter (batched Welford / Chan merge).

Notation: B rows in one observed batch (all leading dims flattened; rows are independent samples, the
batch-independence assumption of LoKA III-A), K input features, G covariance blocks of width Kb (G*Kb >= K).

Representation (bounded memory): the scatter is kept block-diagonal, as a (G, Kb, Kb) tensor.
  - "full":  G = 1, Kb = K: the exact K x K scatter (used when K <= max_full_covariance).
  - "block_diagonal:Kb": K is split into consecutive blocks of Kb features (the last block zero-padded);
    memory is O(K * Kb) instead of O(K^2). Kept: mean, per-feature variance, every correlation *inside* a
    block. Lost: correlations *between* features of different blocks (samples treat blocks as independent).
Also kept per feature: the max |x| seen (merges by max), for outlier inspection; it is not used to sample.

Row sampling (``sample_rows``): an observed input with more rows than that folds a uniform sample of its rows (drawn
with replacement from a generator of the tracker's own, so the training's random stream is untouched) into the
count, mean and scatter; the rows are i.i.d., so the estimates stay unbiased, and the cost of the scatter, the
(B, K) x (B, K) product that dominates an observation, is bounded by sample_rows * K^2. max |x| still covers every row.
The n-th observed call (n from 0) draws from the seed (tracker seed, n); the state dict carries n as ``calls``, so a
run resumed from a checkpoint draws the rows the uninterrupted run would have. A state without ``calls`` loads with
n = 0: the samples stay uniform, but are not the uninterrupted run's.

Chan merge of (n_a, mu_a, S_a) and (n_b, mu_b, S_b), n = n_a + n_b, d = mu_b - mu_a:
  mu = mu_a + (n_b / n) d,   S = S_a + S_b + (n_a n_b / n) d d^T.   Covariance = S / (n - 1).
The merge is associative and commutative, so per-rank partials can be merged in any order.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import torch

STATS_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def representation_name(num_features: int, block: int) -> str:
    """'full' when one block covers all features, else 'block_diagonal:<block>'."""
    return "full" if block >= num_features else f"block_diagonal:{block}"


def choose_block(num_features: int, *, max_full_covariance: int, covariance_block: int) -> int:
    """Block width Kb: K itself when K <= max_full_covariance, else covariance_block."""
    if max_full_covariance < 1 or covariance_block < 1:
        raise ValueError("max_full_covariance and covariance_block must be >= 1")
    return num_features if num_features <= max_full_covariance else min(covariance_block, num_features)


@dataclasses.dataclass
class Moments:
    """Sufficient statistics. count: scalar; mean: (K,); scatter: (G, Kb, Kb); max_abs: (K,)."""

    count: torch.Tensor
    mean: torch.Tensor
    scatter: torch.Tensor
    max_abs: torch.Tensor

    @property
    def num_features(self) -> int:
        return self.mean.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(count, mean, scatter, max_abs) without copying (dataclasses.astuple would deep-copy them)."""
        return self.count, self.mean, self.scatter, self.max_abs

    @property
    def block(self) -> int:
        return self.scatter.shape[-1]


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, K) -> (B, G, Kb), zero-padding K up to G*Kb."""
    num_rows, num_features = x.shape
    num_blocks = math.ceil(num_features / block)
    pad = num_blocks * block - num_features
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(num_rows, num_blocks, block)


@torch.no_grad()
def batch_moments(x: torch.Tensor, *, block: int, compute_dtype: torch.dtype = torch.float32,
                  sample_rows: int = 0, generator: Optional[torch.Generator] = None) -> Moments:
    """Moments of one batch. x: (..., K) -> count (), mean (K,), scatter (G, Kb, Kb), max_abs (K,).

    ``sample_rows`` > 0 and fewer than the B rows of x: count, mean and scatter come from that many rows drawn
    uniformly with replacement (``generator`` on x's device); max_abs always covers all B rows. The scatter is
    formed from the *centered* rows, so computing it in fp32 loses little even when the mean is large; the caller
    accumulates the merged result in its (usually fp64) stats dtype. B = 0 gives empty moments (count 0).
    """
    rows = x.detach().reshape(-1, x.shape[-1])  # (B, K), x's dtype
    if rows.shape[0] == 0:  # an empty call (B = 0) adds nothing; its mean would be NaN and poison the merge
        return empty_moments(rows.shape[1], block, dtype=compute_dtype, device=rows.device)
    max_abs = torch.linalg.vector_norm(rows, ord=float("inf"), dim=0).to(compute_dtype)  # one pass, no |x| copy
    if 0 < sample_rows < rows.shape[0]:
        picked = torch.randint(rows.shape[0], (sample_rows,), device=rows.device, generator=generator)
        rows = rows.index_select(0, picked)  # (sample_rows, K)
    x2 = rows.to(compute_dtype)
    mean = x2.mean(dim=0)  # (K,)
    centered = _blocked(x2 - mean, block)  # (B', G, Kb)
    scatter = torch.einsum("bgi,bgj->gij", centered, centered)  # (G, Kb, Kb)
    count = x2.new_full((), float(x2.shape[0]))  # a fill kernel, not a host-to-device copy (which syncs)
    return Moments(count, mean, scatter, max_abs)


def _block_outer(d: torch.Tensor, block: int) -> torch.Tensor:
    """Block-diagonal part of d d^T. d: (K,) -> (G, Kb, Kb)."""
    db = _blocked(d.unsqueeze(0), block)[0]  # (G, Kb)
    return db.unsqueeze(-1) * db.unsqueeze(-2)


@torch.no_grad()
def merge_moments(a: Moments, b: Moments) -> Moments:
    """Chan merge of two partial statistics (same K and block); result in a's dtype. Either may be empty."""
    dtype = a.mean.dtype
    b_count, b_mean = b.count.to(dtype), b.mean.to(dtype)  # b's (G, Kb, Kb) scatter is promoted inside the sum
    count = a.count + b_count
    safe = count.clamp_min(1.0)  # both empty -> weights 0, no NaN; no host sync (this runs inside forward)
    d = b_mean - a.mean  # (K,)
    mean = a.mean + (b_count / safe) * d
    db = _blocked(d.unsqueeze(0), a.block)[0]  # (G, Kb)
    # S_a + S_b + w d d^T over the blocks, the outer product fused into one pass over the (G, Kb, Kb) sum
    scatter = torch.addcmul(a.scatter + b.scatter, ((a.count * b_count / safe) * db).unsqueeze(-1),
                            db.unsqueeze(-2)).to(dtype)
    return Moments(count, mean, scatter, torch.maximum(a.max_abs, b.max_abs.to(dtype)))


@torch.no_grad()
def merge_all(parts: Iterable[Moments]) -> Moments:
    """Merge any number of partials (associative, so the order does not matter beyond rounding)."""
    parts = list(parts)
    out = parts[0]
    for part in parts[1:]:
        out = merge_moments(out, part)
    return out


def empty_moments(num_features: int, block: int, *, dtype: torch.dtype,
                  device: Optional[torch.device] = None) -> Moments:
    """Zero statistics for K features: mean (K,), scatter (G, Kb, Kb)."""
    num_blocks = math.ceil(num_features / block)
    return Moments(
        torch.zeros((), dtype=dtype, device=device),
        torch.zeros(num_features, dtype=dtype, device=device),
        torch.zeros(num_blocks, block, block, dtype=dtype, device=device),
        torch.zeros(num_features, dtype=dtype, device=device),
    )


@torch.no_grad()
def summary_scalars(m: Moments) -> torch.Tensor:
    """(3,): mean, standard deviation and max |x| over every element of the rows m was formed from (fp32), read
    off the moments (the variance from the scatter's diagonal), so that no pass over the input is needed."""
    count = m.count.clamp_min(1.0)
    feature_var = m.scatter.diagonal(dim1=-2, dim2=-1).reshape(-1)[: m.num_features] / count  # (K,), biased
    overall_mean = m.mean.mean()
    variance = (feature_var + m.mean.square()).mean() - overall_mean.square()
    return torch.stack([overall_mean, variance.clamp_min(0.0).sqrt(), m.max_abs.amax()]).float()


@torch.no_grad()
def block_covariance(m: Moments) -> torch.Tensor:
    """Unbiased covariance blocks S / (n - 1): (G, Kb, Kb). Needs n > 1."""
    if float(m.count) <= 1:
        raise ValueError(f"covariance needs more than one observed row, got count={float(m.count):g}")
    return m.scatter / (m.count - 1)


@torch.no_grad()
def dense_covariance(m: Moments) -> torch.Tensor:
    """Covariance as a (K, K) matrix (zeros off the blocks). For tests and small K only."""
    blocks = block_covariance(m)
    full = torch.block_diag(*blocks.unbind(0))
    return full[: m.num_features, : m.num_features]


class ActivationTracker:
    """Accumulates Moments of one Linear's input over observed batches (fp64 or fp32 accumulators)."""

    def __init__(self, num_features: int, *, max_full_covariance: int = 4096, covariance_block: int = 256,
                 stats_dtype: str = "float64", device: Optional[torch.device] = None, sample_rows: int = 0,
                 seed: int = 0):
        if stats_dtype not in STATS_DTYPES:
            raise ValueError(f"stats_dtype={stats_dtype!r}; valid values: {', '.join(STATS_DTYPES)}")
        if sample_rows < 0:
            raise ValueError(f"sample_rows={sample_rows}; valid values: 0 (every row) or a row count >= 1")
        self.sample_rows, self.seed = sample_rows, seed
        self._generator: Optional[torch.Generator] = None  # made on the first input's device
        self.calls = 0  # observed calls folded in so far: numbers each call's row sample
        self.block = choose_block(num_features, max_full_covariance=max_full_covariance,
                                  covariance_block=covariance_block)
        self.moments = empty_moments(num_features, self.block, dtype=STATS_DTYPES[stats_dtype], device=device)
        self.rows_per_call = 0  # rows of the last observed call: the GEMM's M at this layer

    @property
    def representation(self) -> str:
        return representation_name(self.moments.num_features, self.block)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> Moments:
        """Fold in one batch x: (..., K); returns that batch's own Moments."""
        if x.shape[-1] != self.moments.num_features:
            raise ValueError(f"activation has {x.shape[-1]} features, tracker expects {self.moments.num_features}")
        if self.moments.mean.device != x.device:
            self.moments = Moments(*(t.to(x.device) for t in self.moments.tensors()))
        batch = batch_moments(x, block=self.block, sample_rows=self.sample_rows,
                              generator=self._rows_generator(x.device))
        self.moments = merge_moments(self.moments, batch)
        if x.numel():  # an empty call says nothing about the GEMM's M
            self.rows_per_call = x.numel() // x.shape[-1]
        self.calls += 1
        return batch

    def _rows_generator(self, device: torch.device) -> Optional[torch.Generator]:
        """The tracker's own random stream for the row sample of call number ``calls`` (None when every row is
        folded): seeded from (seed, calls) rather than carried on, so that it depends on nothing a checkpoint lacks.
        Seeding is host-side state, no device sync."""
        if self.sample_rows == 0:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        # 32 bits: the CPU generator keeps only those; an odd step makes every call's seed distinct (mod 2^32)
        self._generator.manual_seed((self.seed + self.calls * 0x9E3779B9) & 0xFFFFFFFF)
        return self._generator

    def state_dict(self) -> dict:
        """count (), mean (K,), scatter (G, Kb, Kb), max_abs (K,), representation, rows_per_call, and ``calls``: the
        number of observed calls, which numbers the next call's row sample."""
        m = self.moments
        return {"count": m.count, "mean": m.mean, "scatter": m.scatter, "max_abs": m.max_abs,
                "representation": self.representation, "rows_per_call": self.rows_per_call, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        dtype, device = self.moments.mean.dtype, self.moments.mean.device
        loaded = Moments(*(state[k].to(dtype=dtype, device=device) for k in ("count", "mean", "scatter", "max_abs")))
        if loaded.scatter.shape != self.moments.scatter.shape or loaded.mean.shape != self.moments.mean.shape:
            raise ValueError(f"activation state has scatter {tuple(loaded.scatter.shape)}, this tracker keeps "
                             f"{tuple(self.moments.scatter.shape)} ({self.representation}): another number of "
                             f"features, max_full_covariance or covariance_block")
        self.moments = loaded
        self.rows_per_call = int(state.get("rows_per_call", 0))
        self.calls = int(state.get("calls", 0))


def moments_from_state(state: dict) -> Moments:
    """Moments from an ActivationTracker.state_dict() (e.g. loaded from a stats file)."""
    return Moments(state["count"], state["mean"], state["scatter"], state["max_abs"])
