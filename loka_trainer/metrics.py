"""CTR metrics over every rank's examples: log loss, normalized entropy (NE), AUC.

NE = log loss / entropy of the base rate p̄ (the log loss of always predicting the mean label): NE < 1 means the
model beats the base rate; lower is better. AUC is the Mann-Whitney statistic with ties counted as one half.

Log loss and NE come from torchrec.metrics' ``NEMetric`` (four sums per rank, all-reduced at compute). AUC comes
from torchmetrics' exact ``BinaryAUROC``: torchrec's ``AUCMetric`` breaks tied scores by sort order (a tie between
a positive and a negative counts 0 or 1, not 1/2), and bf16 logits tie often. An exact AUC needs every score on
the computing rank; ``BinaryAUROC`` all-gathers them as tensors at compute.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torchmetrics.classification import BinaryAUROC
from torchrec.metrics.metrics_config import RecTaskInfo
from torchrec.metrics.ne import NEMetric

_TASK = RecTaskInfo(name="ctr", label_name="label", prediction_name="prediction", weight_name="weight")
_NE_KEY, _LOGLOSS_KEY = "ne-ctr|lifetime_ne", "ne-ctr|lifetime_logloss"


class CTRMetrics:
    """Accumulates (logits, labels) batches; ``compute`` gives the metrics over everything since ``reset``.

    With ``sync=True`` and an initialized process group, ``compute`` covers the examples of every rank (a
    collective: every rank must call it); with ``sync=False`` only this rank's. Metric state lives on ``device``
    (the process group's device: CUDA for NCCL).
    """

    def __init__(self, *, sync: bool = True, device: Optional[torch.device] = None):
        distributed = sync and torch.distributed.is_initialized()
        world_size = torch.distributed.get_world_size() if distributed else 1
        rank = torch.distributed.get_rank() if distributed else 0
        self._distributed = distributed
        # The window metric is unused (we read the lifetime values, reset by the caller); its size is the least
        # torchrec accepts (one example per rank).
        self._ne = NEMetric(world_size=world_size, my_rank=rank, batch_size=1, window_size=world_size,
                            tasks=[_TASK], compute_on_all_ranks=True, include_logloss=True).to(device)
        self._auc = BinaryAUROC(sync_on_compute=distributed).to(device)
        self._class_counts = torch.zeros(2, dtype=torch.float64, device=device)  # [positives, negatives]

    @torch.no_grad()
    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """logits, labels: (N,) on ``device``. Probabilities in fp64, so that distinct fp32 logits stay distinct."""
        probabilities = torch.sigmoid(logits.detach().double())
        labels = labels.detach()
        self._ne.update(predictions={_TASK.name: probabilities}, labels={_TASK.name: labels.double()},
                        weights={_TASK.name: torch.ones_like(probabilities)})
        self._auc.update(probabilities, labels.long())
        positives = labels.double().sum()
        self._class_counts += torch.stack([positives, labels.numel() - positives])

    @torch.no_grad()
    def compute(self) -> dict[str, float]:
        """{"logloss": nats per example, "ne", "auc" (both NaN when only one class is present: the base rate's
        entropy, NE's denominator, is then 0 and torchrec's clamp makes NE about 1e12), "examples"}."""
        ne_states = self._ne.compute() if self._distributed else self._ne.local_compute()
        ne_states = {k.replace("|local_", "|"): v for k, v in ne_states.items()}
        counts = self._class_counts_over_ranks()
        one_class = counts.min().item() == 0
        return {"logloss": ne_states[_LOGLOSS_KEY].item() * math.log(2),  # torchrec's log loss is in bits
                "ne": float("nan") if one_class else ne_states[_NE_KEY].item(),
                "auc": float("nan") if one_class else self._auc.compute().item(),
                "examples": int(counts.sum().item())}

    def _class_counts_over_ranks(self) -> torch.Tensor:
        """(2,) float64: [positives, negatives] over the ranks this metric covers (NaN AUC needs both)."""
        counts = self._class_counts
        if self._distributed:
            counts = counts.clone()
            torch.distributed.all_reduce(counts)
        return counts

    def reset(self) -> None:
        self._ne.reset()
        self._auc.reset()
        self._class_counts.zero_()


def ctr_metrics(logits: torch.Tensor, labels: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """logits, labels: (N,) on this rank only. {prefix + "logloss" | "ne" | "auc"}."""
    metrics = CTRMetrics(sync=False, device=logits.device)
    metrics.update(logits, labels)
    values = metrics.compute()
    return {f"{prefix}{k}": values[k] for k in ("logloss", "ne", "auc")}


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """logits, labels: (N,). Mean binary cross-entropy in nats."""
    return ctr_metrics(logits, labels)["logloss"]


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """logits, labels: (N,). Log loss divided by the entropy of the empirical base rate."""
    return ctr_metrics(logits, labels)["ne"]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """scores (logits), labels: (N,). Area under the ROC curve; NaN when only one class is present."""
    return ctr_metrics(scores, labels)["auc"]
