"""The planted teacher: a fixed random CTR model, a function of the seed only, that labels synthetic rows.

Notation: B batch, F_s sparse features, F_d dense features, F_q sequence features, D latent dim, H MLP width.

    logit = bias + logit_std * sum_c sqrt(share_c) * standardize(component_c)

Components (each standardized on a fixed calibration sample, so the shares are variance shares):
    first_order  sum_f a_f * w_f(id)                         per-id biases (learnable for frequent ids)
    fm           sum_{i<j} <v_i, v_j> over sparse v_f = a_f * mean_bag z_f(id) and dense v = x_k * u_k
    dense_mlp    w2 . relu(W1 x + b1) on standardized log1p counts
    seq_bias     sum_q recency-weighted mean of per-item scalars of seq_q  (what the user did lately)
    seq_match    sum_q <recency-weighted mean of item vectors of seq_q, candidate vector of cat_(q mod F_s)>
Recency weights decay with the age of an event, so a model that sees the order beats a bag of items.
Per-id vectors come from ``hashing.hashed_normal`` (no tables). With ``drift`` the id vectors rotate slowly:
z(id, day) = cos(drift * day) z_a(id) + sin(drift * day) z_b(id).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from loka_trainer.data.batch import Batch
from loka_trainer.data.hashing import derive_seed, generator, hashed_normal

# Variance shares; the two sequence terms only exist with sequences (the others are then renormalized). The
# per-item seq_bias is there because a bilinear match alone is learned too slowly from small initial embeddings
# to give a sequence model a visible edge in a short run.
COMPONENT_SHARES = {"first_order": 0.22, "fm": 0.3, "dense_mlp": 0.16, "seq_bias": 0.16, "seq_match": 0.16}
RECENCY_DECAY = 0.8  # weight of an item = RECENCY_DECAY ** (age in events); newest item weight 1
MLP_WIDTH = 16
_DRIFT_SALT = 0x5DEECE66D


@dataclasses.dataclass(frozen=True)
class TeacherParams:
    """Fixed random teacher. Tensors: importance (F_s,), dense_vectors (F_d, D), w1 (F_d, H), b1 (H,), w2 (H,).

    ``*_mean``/``*_std`` are set by ``calibrate_teacher``; before that ``teacher_logits`` refuses to run.
    """

    seed: int
    latent_dim: int
    num_sparse: int
    num_sequences: int
    drift: float
    importance: torch.Tensor
    dense_vectors: torch.Tensor
    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    dense_mean: Optional[torch.Tensor] = None
    dense_std: Optional[torch.Tensor] = None
    component_mean: Optional[dict] = None
    component_std: Optional[dict] = None
    logit_std: float = 1.0
    bias: float = 0.0

    def salt(self, kind: str, index: int) -> int:
        return derive_seed(self.seed, "teacher", kind, index)


def draw_teacher_params(*, seed: int, num_dense: int, num_sparse: int, num_sequences: int, latent_dim: int,
                        drift: float) -> TeacherParams:
    """Draw the uncalibrated teacher from ``seed`` alone (same seed -> same teacher)."""
    gen = generator(derive_seed(seed, "teacher"))
    importance = torch.exp(0.5 * torch.randn(num_sparse, generator=gen))
    importance = importance / importance.pow(2).mean().sqrt()
    return TeacherParams(
        seed=seed, latent_dim=latent_dim, num_sparse=num_sparse, num_sequences=num_sequences, drift=drift,
        importance=importance,
        dense_vectors=torch.randn(num_dense, latent_dim, generator=gen),
        w1=torch.randn(num_dense, MLP_WIDTH, generator=gen) / math.sqrt(num_dense),
        b1=0.5 * torch.randn(MLP_WIDTH, generator=gen),
        w2=torch.randn(MLP_WIDTH, generator=gen) / math.sqrt(MLP_WIDTH),
    )


@torch.no_grad()
def _id_vectors(ids: torch.Tensor, salts: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """ids, salts: (N,) int64 -> (N, dim) float32, rotated by ``theta`` radians of drift."""
    vectors = hashed_normal(ids, salts, dim)
    if theta != 0.0:
        vectors = math.cos(theta) * vectors + math.sin(theta) * hashed_normal(ids, salts ^ _DRIFT_SALT, dim)
    return vectors


@dataclasses.dataclass(frozen=True)
class Bags:
    """Where the ids of a KeyedJaggedTensor (K keys, batch B, N ids) pool, shared by every pooling of it.

    bag: (N,) the (key, row) bag of each id, key-major; pairs: (P,) each distinct (id, key) as id * K + key;
    inverse: (N,) each id's index into pairs. Ids are Zipf-distributed, so a batch repeats its popular ids many
    times, and each distinct one is hashed once.
    """

    num_keys: int
    batch_size: int
    bag: torch.Tensor
    pairs: torch.Tensor
    inverse: torch.Tensor

    @staticmethod
    @torch.no_grad()
    def of(kjt: KeyedJaggedTensor) -> "Bags":
        num_keys = len(kjt.keys())
        lengths = kjt.lengths().long()  # (K * B,) key-major
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        batch_size = lengths.numel() // num_keys
        pairs, inverse = torch.unique(kjt.values().long() * num_keys + bag // batch_size, return_inverse=True)
        return Bags(num_keys, batch_size, bag, pairs, inverse)


@torch.no_grad()
def pooled_vectors(kjt: KeyedJaggedTensor, key_salts: torch.Tensor, dim: int, theta: float,
                   weights: Optional[torch.Tensor] = None, bags: Optional[Bags] = None) -> torch.Tensor:
    """Weighted mean of per-id vectors per (row, key). key_salts: (K,) int64; weights: (N,) or None; bags:
    ``Bags.of(kjt)`` where the caller pools ``kjt`` more than once.

    Returns (B, K, dim) float32; an empty bag pools to zeros.
    """
    bags = Bags.of(kjt) if bags is None else bags
    k, num_bags = bags.num_keys, bags.num_keys * bags.batch_size
    w = torch.ones(bags.bag.numel()) if weights is None else weights.float()
    vectors = _id_vectors(bags.pairs // k, key_salts[bags.pairs % k], dim, theta)[bags.inverse] * w[:, None]  # (N, D)
    sums = torch.zeros(num_bags, dim).index_add_(0, bags.bag, vectors)
    norms = torch.zeros(num_bags).index_add_(0, bags.bag, w).clamp_min(1e-12)
    return (sums / norms[:, None]).view(k, bags.batch_size, dim).transpose(0, 1)


def _recency_weights(lengths: torch.Tensor) -> torch.Tensor:
    """lengths: (K * B,) -> (N,) weights RECENCY_DECAY ** age, age 0 for the newest (last) item of a bag."""
    ends = torch.cumsum(lengths, 0)
    bag_end = torch.repeat_interleave(ends, lengths)
    age = bag_end - 1 - torch.arange(int(ends[-1]) if ends.numel() else 0)
    return torch.pow(RECENCY_DECAY, age.double()).float()


@torch.no_grad()
def teacher_components(params: TeacherParams, batch: Batch, x: torch.Tensor,
                       day: float = 0.0) -> dict[str, torch.Tensor]:
    """Unstandardized teacher components, each (B,) float32, keyed like ``COMPONENT_SHARES``.

    x: (B, F_d) standardized dense features of ``batch``.
    """
    theta = params.drift * day
    dim = params.latent_dim
    salts_first = torch.tensor([params.salt("first", f) for f in range(params.num_sparse)])
    salts_latent = torch.tensor([params.salt("latent", f) for f in range(params.num_sparse)])
    sparse = Bags.of(batch.sparse)
    first = pooled_vectors(batch.sparse, salts_first, 1, theta, bags=sparse)[..., 0]  # (B, F_s)
    out = {"first_order": (first * params.importance).sum(1)}
    sparse_v = pooled_vectors(batch.sparse, salts_latent, dim, theta, bags=sparse)  # (B, F_s, D)
    sparse_v = sparse_v * params.importance[:, None]
    dense_v = x[:, :, None] * params.dense_vectors  # (B, F_d, D)
    v = torch.cat([sparse_v, dense_v], 1)
    out["fm"] = 0.5 * (v.sum(1).pow(2).sum(1) - v.pow(2).sum((1, 2)))
    out["dense_mlp"] = torch.relu(x @ params.w1 + params.b1) @ params.w2
    if params.num_sequences > 0 and batch.sequences is not None:
        out.update(_sequence_components(params, batch, theta))
    return out


def _sequence_components(params: TeacherParams, batch: Batch, theta: float) -> dict[str, torch.Tensor]:
    seqs = batch.sequences
    num_seq = params.num_sequences
    recency = _recency_weights(seqs.lengths().long())
    salts_bias = torch.tensor([params.salt("item_bias", q) for q in range(num_seq)])
    items = Bags.of(seqs)
    item_bias = pooled_vectors(seqs, salts_bias, 1, theta, weights=recency, bags=items)[..., 0]  # (B, F_q)
    salts_item = torch.tensor([params.salt("item", q) for q in range(num_seq)])
    interest = pooled_vectors(seqs, salts_item, params.latent_dim, theta, weights=recency, bags=items)  # (B, F_q, D)
    cand_features = [q % params.num_sparse for q in range(num_seq)]
    cand_kjt = batch.sparse.permute(cand_features)
    salts_cand = torch.tensor([params.salt("candidate", q) for q in range(num_seq)])
    candidate = pooled_vectors(cand_kjt, salts_cand, params.latent_dim, theta)  # (B, F_q, D)
    return {"seq_bias": item_bias.sum(1), "seq_match": (interest * candidate).sum((1, 2))}


def _standardize_dense(params: TeacherParams, dense: torch.Tensor) -> torch.Tensor:
    return (dense - params.dense_mean) / params.dense_std


@torch.no_grad()
def teacher_logits(params: TeacherParams, batch: Batch, day: float = 0.0) -> torch.Tensor:
    """The teacher's logit for each row of ``batch`` at simulated ``day``. -> (B,) float32."""
    assert params.component_mean is not None, "teacher_logits needs a calibrated teacher (calibrate_teacher)"
    return combine_components(params, teacher_components(params, batch, _standardize_dense(params, batch.dense), day))


def combine_components(params: TeacherParams, comps: dict[str, torch.Tensor]) -> torch.Tensor:
    """bias + logit_std * sum_c sqrt(share_c) * standardized component_c. comps: name -> (B,) -> (B,)."""
    shares = _shares(comps)
    total = sum(math.sqrt(shares[name]) * (value - params.component_mean[name]) / params.component_std[name]
                for name, value in comps.items())
    return params.bias + params.logit_std * total


def _shares(comps: dict) -> dict[str, float]:
    """Variance shares of the components present, renormalized to sum to 1."""
    total = sum(COMPONENT_SHARES[name] for name in comps)
    return {name: COMPONENT_SHARES[name] / total for name in comps}


@torch.no_grad()
def calibrate_teacher(params: TeacherParams, batch: Batch, *, target_ctr: float, logit_std: float) -> TeacherParams:
    """Fix standardization stats, logit scale and the bias giving ``target_ctr`` on a calibration ``batch``."""
    dense_mean = batch.dense.mean(0)
    dense_std = batch.dense.std(0).clamp_min(1e-3)
    params = dataclasses.replace(params, dense_mean=dense_mean, dense_std=dense_std)
    comps = teacher_components(params, batch, _standardize_dense(params, batch.dense))
    params = dataclasses.replace(
        params,
        component_mean={k: float(v.mean()) for k, v in comps.items()},
        component_std={k: max(float(v.std()), 1e-6) for k, v in comps.items()},
        logit_std=logit_std,
    )
    centered = combine_components(params, comps)
    return dataclasses.replace(params, bias=solve_bias(centered, target_ctr))


@torch.no_grad()
def solve_bias(logits: torch.Tensor, target_ctr: float, iters: int = 60) -> float:
    """The b with mean(sigmoid(logits + b)) = target_ctr, by bisection. logits: (N,)."""
    lo, hi = -30.0, 30.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if torch.sigmoid(logits.double() + mid).mean().item() < target_ctr:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
