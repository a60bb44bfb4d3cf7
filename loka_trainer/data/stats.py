"""What the synthetic data looks like and how good a model can get on it (JSON + PNG).

    python -m loka_trainer.data.stats --out runs/data_stats --batches 50 num_sequences=2 batch_size=1024

Bayes log loss / NE / AUC are the teacher's own scores on the eval stream: the floor no model can beat, to
put a run's log loss and the BF16-vs-FP8 differences in proportion.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from loka_trainer.data.config import DataConfig
from loka_trainer.data.synthetic import SyntheticSource
from loka_trainer.field_types import dotted


@torch.no_grad()
def rank_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney AUC, ties counted half. scores: (N,); labels: (N,) in {0, 1} with both classes present."""
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # average 1-based rank within each tie group
    num_pos = labels.double().sum()
    num_neg = labels.numel() - num_pos
    return float((ranks[labels == 1].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


@torch.no_grad()
def bayes_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Log loss, normalized entropy (log loss / entropy of the CTR) and AUC of ``logits`` (N,) on ``labels`` (N,)."""
    ctr = float(labels.mean())
    log_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double()))
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    return {"ctr": ctr, "log_loss": log_loss, "ne": log_loss / entropy, "auc": rank_auc(logits, labels)}


@torch.no_grad()
def head_coverage(ids: torch.Tensor, top_fraction: float = 0.01) -> float:
    """Share of occurrences taken by the most frequent ``top_fraction`` of the distinct ids. ids: (N,)."""
    counts = torch.unique(ids, return_counts=True)[1].sort(descending=True).values
    top = max(1, int(len(counts) * top_fraction))
    return float(counts[:top].sum()) / ids.numel()


def dataset_stats(cfg: DataConfig, num_batches: int, *, progress: bool = True) -> dict:
    """Statistics of ``num_batches`` eval batches (rank 0 of 1) of the synthetic source."""
    source = SyntheticSource(cfg)
    batches = [source.batch_at("eval", i) for i in tqdm(range(num_batches), desc="data stats", disable=not progress)]
    labels = torch.cat([b.labels for b in batches])
    logits = torch.cat([source.logits(b) for b in batches])
    keys = batches[0].sparse.keys()
    per_key = [torch.cat([b.sparse.values().view(len(keys), -1)[k] for b in batches]) for k in range(len(keys))]
    stats = {
        "config": dataclasses.asdict(cfg),
        "num_rows": labels.numel(),
        "bayes": bayes_metrics(logits, labels),
        "logits": logits.tolist(),
        "sparse": {k: {"vocab": v, "distinct": int(ids.unique().numel()), "top1pct_share": head_coverage(ids)}
                   for k, v, ids in zip(keys, source.spec.schema.sparse_vocab_sizes, per_key)},
        "dense_quantiles": {q: torch.cat([b.dense for b in batches]).quantile(q, dim=0).tolist()
                            for q in (0.5, 0.9, 0.99)},
    }
    if batches[0].sequences is not None:
        stats["sequence_lengths"] = torch.cat([b.sequences.lengths() for b in batches]).tolist()
    return stats


def plot_stats(stats: dict, path: Path) -> None:
    """Teacher logits by label, head share per sparse feature, sequence lengths: one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    bayes = stats["bayes"]
    axes[0].hist(stats["logits"], bins=80, color="tab:blue")
    axes[0].set_title(f"teacher logits (CTR {bayes['ctr']:.3f}, Bayes AUC {bayes['auc']:.3f}, NE {bayes['ne']:.3f})")
    names = list(stats["sparse"])
    axes[1].bar(range(len(names)), [stats["sparse"][n]["top1pct_share"] for n in names], color="tab:orange")
    axes[1].set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    axes[1].set_title("share of occurrences of the top 1% ids (Zipf head)")
    if "sequence_lengths" in stats:
        lengths = stats["sequence_lengths"]
        axes[2].hist(lengths, bins=[b + 0.5 for b in range(max(lengths) + 1)], color="tab:green")  # one per length
        axes[2].set_title("behaviour sequence lengths")
    else:
        axes[2].axis("off")
    fig.suptitle(f"synthetic data, {stats['num_rows']} eval rows, seed {stats['config']['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for data_stats.json and data_stats.png")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("overrides", nargs="*", help="DataConfig fields as key=value")
    args = parser.parse_args(argv)
    try:
        cfg = _apply_overrides(DataConfig(), args.overrides)
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))  # one line and exit 2, as for train.py's overrides
    stats = dataset_stats(cfg, args.batches)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in stats.items() if k not in ("logits", "sequence_lengths")}
    (args.out / "data_stats.json").write_text(json.dumps(summary, indent=2))
    plot_stats(stats, args.out / "data_stats.png")
    print(json.dumps(summary["bayes"]))
    return summary


def _apply_overrides(cfg: DataConfig, overrides: Sequence[str]) -> DataConfig:
    """``cfg`` with ``key=value`` overrides applied; nested fields by dotted key (``outliers.spike_rate=0.01``)."""
    cfg = copy.deepcopy(cfg)
    settable = dotted(dataclasses.asdict(cfg))
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in settable:
            raise ValueError(f"unknown data field {key!r}; valid: {sorted(settable)}")
        *parents, name = key.split(".")
        owner = functools.reduce(getattr, parents, cfg)
        setattr(owner, name, _parse_value(key, settable[key], value))
    return cfg


def _parse_value(key: str, default, value: str):
    if isinstance(default, bool):  # bool("false") is True
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{key} takes true or false, got {value!r}")
        return value.lower() == "true"
    if default is None or isinstance(default, str):
        return value
    try:
        return type(default)(value)
    except ValueError:
        raise ValueError(f"{key} must be {'an integer' if isinstance(default, int) else 'a number'}, "
                         f"got {value!r}") from None


if __name__ == "__main__":
    main()
