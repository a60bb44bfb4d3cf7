"""Matrix-normal weight statistics W ~ MN(M, U, V) of the deviation around the running mean, tracked online.

Notation: the Linear weight W is (O, I) = (out_features, in_features); mean M (O, I); row covariance U (O, O);
column covariance V (I, I); vec(W) has covariance V (x) U. Only V (x) U is identifiable, so U is normalized to
trace(U) = O and the scale lives in V: trace(V) / I = sigma2, the mean per-element variance.

Observations W_1 .. W_t are weighted w_s = m^(t-s) (momentum m, 0 < m < 1), with
  S_t = sum_s w_s = (1 - m^t) / (1 - m),   Q_t = sum_s w_s^2 = (1 - m^2t) / (1 - m^2),   c_t = S_t - Q_t / S_t,
  R_t = sum_(s=2..t) m^(t-s) (1 - 1/S_s).

Mean, the bias-corrected EMA (Adam's: an accumulator started at zero, divided by 1 - m^t), i.e. the weighted mean:
  M_t = M_(t-1) + (W_t - M_(t-1)) / S_t,   M_1 = W_1.
Deviation around the running mean before the observation:  D_t = W_t - M_(t-1),  t >= 2.

Scale, the weighted variance of the observations around their weighted mean (West's update of the bias-corrected
EMA scatter, divided by c_t, the reliability-weight small-sample correction; unbiased for i.i.d. draws from the
second observation on):
  sigma2_t = (m c_(t-1) / c_t) sigma2_(t-1) + ((1 - 1/S_t) / c_t) |D_t|^2 / (O I).
Shapes, flip-flop moments of the deviation (LoKA III-A, by Cholesky solves, never an inverse), each normalized to
its trace, averaged with the same weights (g_t = (1 - 1/S_t) / R_t; g_2 = 1, so the shapes start from the first
deviation):
  U' = (1/I) D L_V^-T L_V^-1 D^T,   L_V L_V^T = Vs_(t-1) + eps I,   U_t  = (1 - g_t) U_(t-1)  + g_t O U' / trace(U')
  V' = (1/O) D^T L_U^-T L_U^-1 D,   L_U L_U^T = U_t + eps I,        Vs_t = (1 - g_t) Vs_(t-1) + g_t I V' / trace(V')
  V_t = sigma2_t Vs_t                                               (eps = 1e-6 trace / dim)
E[D A D^T] = U trace(V A) for any A independent of D, so the shapes are right whatever whitens them; normalizing
each moment keeps a whitening by an early estimate (singular while fewer vectors than dimensions were seen) from
weighing one moment over the others, and the scale comes from |D|^2 alone.

Nothing starts from W itself: at t = 1 only the mean is set (U = I, V = 0: samples are the mean). A deterministic
drift of the weights enters only through the lag of the running mean, i.e. the drift's variance within the EMA
window, not its distance from the first observation. The stored (count, mean, u, v) are the whole state: the
coefficients above are functions of t and m.

Bounded representation: a factor whose dimension exceeds ``max_full_covariance`` is kept diagonal (a vector),
i.e. those rows (or columns) are modeled as uncorrelated; their variances are kept.
"""
from __future__ import annotations

import dataclasses
import functools
import math
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
    # cholesky_ex: no host sync for the error check. The jitter keeps F + eps I positive definite; a failure
    # would leave NaNs, which the stats loader rejects.
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


@dataclasses.dataclass(frozen=True)
class EmaCoefficients:
    """Scalars of observation t (see the module docstring)."""

    mean_gain: float  # 1 / S_t:            M_t = M_(t-1) + mean_gain (W_t - M_(t-1))
    keep: float  # m c_(t-1) / c_t:          sigma2_t = keep sigma2_(t-1) + gain |D_t|^2 / (O I)
    gain: float  # (1 - 1/S_t) / c_t
    shape_gain: float  # (1 - 1/S_t) / R_t:  F_t = (1 - shape_gain) F_(t-1) + shape_gain F'_t (trace-normalized)


def _weight_sums(t: int, momentum: float) -> tuple[float, float]:
    """(S_t, Q_t): sum of the weights m^(t-s) and of their squares over s = 1..t."""
    s = -math.expm1(t * math.log(momentum)) / (1.0 - momentum)
    q = -math.expm1(2 * t * math.log(momentum)) / (1.0 - momentum**2)
    return s, q


def _normalizer(t: int, momentum: float) -> float:
    """c_t = S_t - Q_t / S_t (0 at t = 1): makes the weighted scatter an unbiased covariance."""
    s, q = _weight_sums(t, momentum)
    return s - q / s


def _deviation_weight(t: int, momentum: float) -> float:
    """R_t = sum_(s=2..t) m^(t-s) (1 - 1/S_s): the total weight of the deviations in the shape averages.
    Terms older than m^(t-s) < 1e-18 are dropped (vectorized: microseconds for any t)."""
    horizon = int(math.ceil(math.log(1e-18) / math.log(momentum)))
    s = torch.arange(max(2, t - horizon), t + 1, dtype=torch.float64)
    weight_sum = -torch.expm1(s * math.log(momentum)) / (1.0 - momentum)  # S_s
    return float((momentum ** (t - s) * (1.0 - 1.0 / weight_sum)).sum())


@functools.lru_cache(maxsize=256)  # every layer of a model is at the same t
def ema_coefficients(t: int, momentum: float) -> EmaCoefficients:
    """Coefficients of the t-th observation (t >= 1); t = 1 only sets the mean."""
    if t < 1 or not 0.0 < momentum < 1.0:
        raise ValueError(f"ema_coefficients: need t >= 1 and 0 < momentum < 1, got t={t}, momentum={momentum}")
    if t == 1:
        return EmaCoefficients(mean_gain=1.0, keep=0.0, gain=0.0, shape_gain=0.0)
    s, _ = _weight_sums(t, momentum)
    c_prev, c = _normalizer(t - 1, momentum), _normalizer(t, momentum)
    new = 1.0 - 1.0 / s
    return EmaCoefficients(mean_gain=1.0 / s, keep=momentum * c_prev / c, gain=new / c,
                           shape_gain=new / _deviation_weight(t, momentum))


def _trace(f: torch.Tensor) -> torch.Tensor:
    return f.sum() if f.ndim == 1 else f.diagonal().sum()


def _average_shape(old: torch.Tensor, moment: torch.Tensor, gain: float) -> torch.Tensor:
    """(1 - gain) old + gain moment', moment' = moment scaled to the trace of old (old kept when moment is 0).
    Branch-free (torch.where, no host sync): on a GPU the update is queued on a side stream and never waits."""
    trace = _trace(moment)
    seen = trace > 0
    f = (1.0 - gain) * old + gain * moment * (_trace(old) / torch.where(seen, trace, 1.0))
    f = torch.where(seen, f, old)
    return 0.5 * (f + f.T) if f.ndim == 2 else f


@torch.no_grad()
def matrix_normal_update(dev: torch.Tensor, u: torch.Tensor, v_shape: torch.Tensor, *,
                         shape_gain: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One flip-flop step of the shapes. dev: (O, I) deviation from the running mean; u: (O, O)|(O,) with
    trace O; v_shape: (I, I)|(I,) with trace I. v_shape whitens the U moment, the fresh U whitens the V moment.
    Returns (u, v_shape) with the same traces."""
    u_moment = _gram(whiten_columns(dev, v_shape), diagonal=u.ndim == 1)  # (O, O) or (O,)
    u = _average_shape(u, u_moment, shape_gain)
    v_moment = _gram(whiten_rows(dev, u).T, diagonal=v_shape.ndim == 1)  # (I, I) or (I,)
    return u, _average_shape(v_shape, v_moment, shape_gain)


def _identity(n: int, *, diagonal: bool, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device) if diagonal else torch.eye(n, dtype=dtype, device=device)


class WeightTracker:
    """Tracks MN(M, U, V) of one (O, I) weight; every rank sees the same full weight, so no merge is needed."""

    def __init__(self, out_features: int, in_features: int, *, momentum: float = 0.99,
                 max_full_covariance: int = 4096, stats_dtype: str = "float64"):
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum={momentum}; valid values: 0 < momentum < 1 (paper: 0.9 to 0.99)")
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
    def state_bytes(self) -> int:
        """Bytes the tracker holds once started: the running mean M (O, I) and the factors U (O, O) or its diagonal
        (O,), V (I, I) or (I,), all in the stats dtype."""
        out_f, in_f = self.shape
        elements = out_f * in_f + (out_f if self.diagonal_u else out_f * out_f) + (in_f if self.diagonal_v else
                                                                                 in_f * in_f)
        return elements * self.dtype.itemsize

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
        self.count += 1
        if self.count == 1:
            self._start(w)
            return
        coef = ema_coefficients(self.count, self.momentum)
        dev = w - self.mean  # (O, I), around the running mean before this observation
        scale, v_shape = self._scale_and_shape()
        self.u, v_shape = matrix_normal_update(dev, self.u, v_shape, shape_gain=coef.shape_gain)
        scale = coef.keep * scale + coef.gain * dev.square().mean()
        self.v = v_shape * scale
        self.mean = self.mean + coef.mean_gain * dev

    def _scale_and_shape(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma2 = trace(V) / I, V / sigma2 with trace I); the identity shape while no deviation was seen."""
        scale = _trace(self.v) / self.shape[1]
        seen = scale > 0  # a tensor: no host sync
        identity = _identity(self.shape[1], diagonal=self.diagonal_v, dtype=self.dtype, device=self.v.device)
        return scale, torch.where(seen, self.v / torch.where(seen, scale, 1.0), identity)

    def _start(self, w: torch.Tensor) -> None:
        """First observation: M = W, no deviation seen yet (U = I, V = 0)."""
        out_features, in_features = self.shape
        self.mean = w.clone()
        self.u = _identity(out_features, diagonal=self.diagonal_u, dtype=self.dtype, device=w.device)
        self.v = torch.zeros_like(_identity(in_features, diagonal=self.diagonal_v, dtype=self.dtype,
                                            device=w.device))

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "u": self.u, "v": self.v,
                "momentum": self.momentum, "representation": self.representation}

    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of U and V in this tracker's representation: (O, O) or (O,), and (I, I) or (I,)."""
        out_f, in_f = self.shape
        return ((out_f,) if self.diagonal_u else (out_f, out_f)), ((in_f,) if self.diagonal_v else (in_f, in_f))

    def load_state_dict(self, state: dict) -> None:
        """A state of another shape or factor representation (another ``max_full_covariance``, i.e.
        ``callbacks.probe.max_full_weight_factor``) is refused with one ValueError line, the tracker unchanged."""
        count = int(state["count"])
        if count == 0:
            self.count, self.mean, self.u, self.v = 0, None, None, None
            return
        mean, u, v = (state[k].to(self.dtype) for k in ("mean", "u", "v"))
        if tuple(mean.shape) != self.shape:
            raise ValueError(f"weight state has mean {tuple(mean.shape)}, expected {self.shape}")
        if (tuple(u.shape), tuple(v.shape)) != self.factor_shapes():
            u_shape, v_shape = self.factor_shapes()
            raise ValueError(f"weight state of {self.shape} has factors U {tuple(u.shape)}, V {tuple(v.shape)}; this "
                             f"tracker keeps U {u_shape}, V {v_shape} ({self.representation}): another "
                             f"max_full_weight_factor")
        self.count, self.mean, self.u, self.v = count, mean, u, v
