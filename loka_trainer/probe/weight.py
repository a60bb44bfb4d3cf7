"""Matrix-normal weight statistics W ~ MN(M, U, V), tracked online with a Kronecker-factored (flip-flop) EMA.

Notation: the Linear weight W is (O, I) = (out_features, in_features); mean M (O, I); row covariance U (O, O);
column covariance V (I, I); vec(W) has covariance V (x) U. Only V (x) U is identifiable, so U is normalized to
trace(U) = O and the scale lives in V.

One update with Wc = W - M (LoKA III-A), never forming an inverse:
  L_V L_V^T = V + eps_V I,  W~ = Wc L_V^{-T},   U' = (1/I) W~ W~^T
  U <- sym(m U + (1 - m) U') + eps_U I
  L_U L_U^T = U + eps_U I,  W^ = L_U^{-1} Wc,   V' = (1/O) W^T W^
  V <- sym(m V + (1 - m) V') + eps_V I
  s = trace(U) / O;  U <- U / s;  V <- V s
with eps = 1e-6 * trace / dim (relative jitter, so it scales with the weights). V' uses the freshly updated U:
that is the flip-flop order and keeps the two factors consistent within a step.

Bounded representation: a factor whose dimension exceeds ``max_full_covariance`` is kept diagonal (a vector),
i.e. those rows (or columns) are modeled as uncorrelated; their variances are kept.

Mean: an EMA of W with the same momentum, so the statistics describe the *recent* weights (and their
step-to-step variation), which is what the FP8 kernels will see. The first observation sets M = W, U = I and
V = var(W) I (an isotropic prior at the weight's own scale) that later updates wash out.
"""
from __future__ import annotations

from typing import Optional

import torch

from loka_trainer.probe.activation import STATS_DTYPES

JITTER = 1e-6


def _eps(f: torch.Tensor) -> torch.Tensor:
    """Relative jitter 1e-6 * trace(F) / n for a full (n, n) or diagonal (n,) factor."""
    diag = f if f.ndim == 1 else f.diagonal()
    return (JITTER * diag.sum() / diag.numel()).clamp_min(torch.finfo(f.dtype).tiny)


def _add_eps(f: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    return f + eps if f.ndim == 1 else f + eps * torch.eye(f.shape[0], dtype=f.dtype, device=f.device)


@torch.no_grad()
def cholesky_factor(f: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of F + eps I. Full (n, n) -> (n, n); diagonal (n,) -> (n,) square roots."""
    f_reg = _add_eps(f, _eps(f))
    if f.ndim == 1:
        return f_reg.sqrt()
    # cholesky_ex: no host sync for the error check (this runs inside the forward). The jitter keeps F + eps I
    # positive definite; a failure would leave NaNs, which the stats loader rejects.
    return torch.linalg.cholesky_ex(f_reg).L


@torch.no_grad()
def whiten_columns(wc: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Wc L_V^{-T} via a triangular solve. wc: (O, I); v: (I, I) or (I,) -> (O, I)."""
    lv = cholesky_factor(v)
    if v.ndim == 1:
        return wc / lv
    return torch.linalg.solve_triangular(lv, wc.T, upper=False).T


@torch.no_grad()
def whiten_rows(wc: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """L_U^{-1} Wc via a triangular solve. wc: (O, I); u: (O, O) or (O,) -> (O, I)."""
    lu = cholesky_factor(u)
    if u.ndim == 1:
        return wc / lu.unsqueeze(1)
    return torch.linalg.solve_triangular(lu, wc, upper=False)


def _gram(a: torch.Tensor, *, diagonal: bool) -> torch.Tensor:
    """(1/cols) A A^T as (rows, rows), or only its diagonal (rows,). a: (rows, cols)."""
    if diagonal:
        return a.square().sum(dim=1) / a.shape[1]
    return a @ a.T / a.shape[1]


def _smooth(old: torch.Tensor, new: torch.Tensor, momentum: float) -> torch.Tensor:
    """EMA, symmetrize, add eps I."""
    f = momentum * old + (1.0 - momentum) * new
    if f.ndim == 2:
        f = 0.5 * (f + f.T)
    return _add_eps(f, _eps(f))


@torch.no_grad()
def matrix_normal_update(wc: torch.Tensor, u: torch.Tensor, v: torch.Tensor, *,
                         momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One flip-flop EMA step. wc: (O, I) centered weight; u: (O, O)|(O,); v: (I, I)|(I,) -> (u, v) renormalized."""
    u_est = _gram(whiten_columns(wc, v), diagonal=u.ndim == 1)  # (O, O) or (O,)
    u = _smooth(u, u_est, momentum)
    v_est = _gram(whiten_rows(wc, u).T, diagonal=v.ndim == 1)  # (I, I) or (I,)
    v = _smooth(v, v_est, momentum)
    return renormalize(u, v)


@torch.no_grad()
def renormalize(u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fix the scale ambiguity of V (x) U: s = trace(U) / O, U <- U / s, V <- V s."""
    trace_u = u.sum() if u.ndim == 1 else u.diagonal().sum()
    s = trace_u / u.shape[0]
    return u / s, v * s


def _identity(n: int, *, diagonal: bool, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device) if diagonal else torch.eye(n, dtype=dtype, device=device)


class WeightTracker:
    """Tracks MN(M, U, V) of one (O, I) weight; every rank sees the same full weight, so no merge is needed."""

    def __init__(self, out_features: int, in_features: int, *, momentum: float = 0.99,
                 max_full_covariance: int = 4096, stats_dtype: str = "float64"):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum}; valid values: 0 <= momentum < 1 (paper: 0.9 to 0.99)")
        if stats_dtype not in STATS_DTYPES:
            raise ValueError(f"stats_dtype={stats_dtype!r}; valid values: {', '.join(STATS_DTYPES)}")
        self.shape = (out_features, in_features)
        self.momentum = momentum
        self.diagonal_u = out_features > max_full_covariance
        self.diagonal_v = in_features > max_full_covariance
        self.dtype = STATS_DTYPES[stats_dtype]
        self.count = 0
        self.mean: Optional[torch.Tensor] = None
        self.u: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    @property
    def representation(self) -> str:
        parts = ("diagonal" if d else "full" for d in (self.diagonal_u, self.diagonal_v))
        return "U:{},V:{}".format(*parts)

    @torch.no_grad()
    def update(self, w: torch.Tensor) -> None:
        """Fold in one observation of the full weight w: (O, I)."""
        if tuple(w.shape) != self.shape:
            raise ValueError(f"weight has shape {tuple(w.shape)}, tracker expects {self.shape}")
        w = w.detach().to(self.dtype)
        if self.mean is not None and self.mean.device != w.device:  # e.g. restored from a CPU checkpoint
            self.mean, self.u, self.v = (t.to(w.device) for t in (self.mean, self.u, self.v))
        if self.count == 0:
            self._initialize(w)
        else:
            self.u, self.v = matrix_normal_update(w - self.mean, self.u, self.v, momentum=self.momentum)
            self.mean = self.momentum * self.mean + (1.0 - self.momentum) * w
        self.count += 1

    def _initialize(self, w: torch.Tensor) -> None:
        out_features, in_features = self.shape
        self.mean = w.clone()
        scale = w.var(correction=0).clamp_min(torch.finfo(self.dtype).tiny) if w.numel() > 1 else w.new_ones(())
        self.u = _identity(out_features, diagonal=self.diagonal_u, dtype=self.dtype, device=w.device)
        self.v = scale * _identity(in_features, diagonal=self.diagonal_v, dtype=self.dtype, device=w.device)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "u": self.u, "v": self.v,
                "momentum": self.momentum, "representation": self.representation}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
        if self.count == 0:
            return
        self.mean, self.u, self.v = (state[k].to(self.dtype) for k in ("mean", "u", "v"))
        if tuple(self.mean.shape) != self.shape:
            raise ValueError(f"weight state has mean {tuple(self.mean.shape)}, expected {self.shape}")
