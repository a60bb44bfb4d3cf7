"""``DataConfig``: the Hydra structured-config schema of the ``data`` group, and its validation.

Only OmegaConf-supported field types (int/float/str/bool/Optional) so the lead can register it in the
ConfigStore as group ``data``, name ``data_schema``; ``conf/data/*.yaml`` fill in the values.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

# NOTE: must equal ``loka_trainer.data.stream.DATA_SOURCES.keys()`` (checked by a test); kept here so that
# validating a config does not import the sources.
SOURCE_NAMES = ("synthetic", "criteo")
CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26


def check_finite(config: Any, prefix: str) -> None:
    """Every float field of the dataclass ``config`` holds a finite number (a one-line ``ValueError`` naming the
    field): NaN fails every comparison, so it slips past range checks, inf past one-sided ones, and either breaks
    the generated batches."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type == "float" and not math.isfinite(value):
            raise ValueError(f"{prefix}.{field.name} must be a finite number, got {value}")


@dataclasses.dataclass
class OutlierConfig:
    """Synthetic only, off by default: rare huge dense values and a few dense channels that are always large.

    ``spike_rate``: probability that a dense value is a spike, log-uniform in [``spike_min``, ``spike_max``] times
    the value (at least 1). ``hot_features`` seed-chosen dense channels are always multiplied by ``hot_scale``.
    The teacher reads the clipped, rescaled values (``data/outliers.py``), so the labels stay learnable.
    """

    spike_rate: float = 0.0
    spike_min: float = 100.0
    spike_max: float = 10_000.0
    hot_features: int = 0
    hot_scale: float = 100.0

    @property
    def enabled(self) -> bool:
        return self.spike_rate > 0.0 or self.hot_features > 0

    def validate(self, num_dense: int) -> None:
        """Raise a one-line ``ValueError`` naming the first bad field."""
        check_finite(self, "data.outliers")
        if not 0.0 <= self.spike_rate <= 1.0:
            raise ValueError(f"data.outliers.spike_rate must be in [0, 1], got {self.spike_rate}")
        if not 1.0 <= self.spike_min <= self.spike_max:
            raise ValueError(f"data.outliers.spike_min and spike_max must satisfy 1 <= spike_min <= spike_max, "
                             f"got {self.spike_min}, {self.spike_max}")
        if not 0 <= self.hot_features <= num_dense:
            raise ValueError(f"data.outliers.hot_features must be in [0, data.num_dense={num_dense}], "
                             f"got {self.hot_features}")
        if self.hot_scale <= 0.0:
            raise ValueError(f"data.outliers.hot_scale must be > 0, got {self.hot_scale}")


# what each source never reads (``outliers`` with criteo is refused in ``validate``)
UNREAD_BY_SOURCE = {
    "synthetic": ("path", "eval_path", "eval_fraction"),
    "criteo": ("seed", "zipf_alpha", "multi_hot", "num_sequences", "max_sequence_length", "sequence_vocab_size",
               "target_ctr", "teacher_logit_std", "teacher_latent_dim", "drift", "batches_per_day"),
}


@dataclasses.dataclass
class DataConfig:
    """Where batches come from. Sizes are per rank; vocab sizes are Criteo-Kaggle-like, capped.

    Synthetic only: ``zipf_alpha``, ``multi_hot``, sequences, the teacher fields, ``drift``, ``outliers``.
    Criteo only: ``path``, ``eval_path`` and ``eval_fraction`` (tail of ``path`` held out when no eval_path).
    ``prefetch``: train batches produced ahead on a background thread (0: off); ``workers``: processes making them
    at once when above 1 (for a Criteo file each reads it all and parses every ``workers``-th batch);
    ``pin_memory`` pins them when CUDA is available, so ``Batch.to(device, non_blocking=True)`` is asynchronous.
    """

    name: str = "synthetic"
    batch_size: int = 512
    seed: int = 0
    num_dense: int = CRITEO_NUM_DENSE
    num_sparse: int = CRITEO_NUM_SPARSE
    max_vocab_size: int = 100_000
    zipf_alpha: float = 1.1
    multi_hot: int = 1
    num_sequences: int = 0
    max_sequence_length: int = 64
    sequence_vocab_size: int = 100_000
    target_ctr: float = 0.25
    teacher_logit_std: float = 1.35  # Bayes AUC ~0.80 at the defaults (CTR 0.25)
    teacher_latent_dim: int = 8
    drift: float = 0.0
    batches_per_day: int = 10_000
    eval_batches: int = 50
    path: Optional[str] = None
    eval_path: Optional[str] = None
    eval_fraction: float = 0.1
    prefetch: int = 2
    workers: int = 1
    pin_memory: bool = True
    outliers: OutlierConfig = dataclasses.field(default_factory=OutlierConfig)

    def unread_settings(self) -> list[str]:
        """The fields set away from their defaults that the source ``name`` does not read (a shared override list,
        a sweep over ``data``, may set them: named, not refused)."""
        defaults = DataConfig()
        return [f"data.{field}" for field in UNREAD_BY_SOURCE[self.name]
                if getattr(self, field) != getattr(defaults, field)]

    def validate(self) -> None:
        """Raise a one-line ``ValueError`` naming the first bad field; never reads data files."""
        if self.name not in SOURCE_NAMES:
            raise ValueError(f"data.name must be one of {list(SOURCE_NAMES)}, got {self.name!r}")
        check_finite(self, "data")
        for field, (bound, strict) in _LOWER_BOUNDS.items():
            value = getattr(self, field)
            if value < bound or (strict and value == bound):
                raise ValueError(f"data.{field} must be {'>' if strict else '>='} {bound}, got {value}")
        for field in ("max_vocab_size", "sequence_vocab_size"):
            # ids are permuted as multiplier * rank with multiplier < 2**31 in int64 arithmetic
            if getattr(self, field) >= 2**31:
                raise ValueError(f"data.{field} must be < 2**31, got {getattr(self, field)}")
        if not 0.0 < self.target_ctr < 1.0:
            raise ValueError(f"data.target_ctr must be in (0, 1), got {self.target_ctr}")
        if self.teacher_logit_std <= 0.0:
            raise ValueError(f"data.teacher_logit_std must be > 0, got {self.teacher_logit_std}")
        self.outliers.validate(self.num_dense)
        if self.name == "criteo" and self.outliers.enabled:
            raise ValueError("data.outliers is synthetic only: set data.outliers.spike_rate=0 and "
                             "data.outliers.hot_features=0 with data.name='criteo'")
        if self.name == "criteo":
            self._validate_criteo()

    def _validate_criteo(self) -> None:
        if self.path is None:
            raise ValueError("data.path must be set to a Criteo TSV file when data.name='criteo', got None")
        for field in ("path", "eval_path"):
            value = getattr(self, field)
            if value is not None and not os.path.isfile(value):
                raise ValueError(f"data.{field} must be an existing Criteo TSV file, got {value!r}")
        fixed = {"num_dense": CRITEO_NUM_DENSE, "num_sparse": CRITEO_NUM_SPARSE, "multi_hot": 1,
                 "num_sequences": 0}
        for field, required in fixed.items():
            if getattr(self, field) != required:
                raise ValueError(f"data.{field} must be {required} for data.name='criteo', got {getattr(self, field)}")
        if self.eval_path is None and self.eval_batches > 0 and not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in (0, 1) when data.eval_path is unset, "
                             f"got {self.eval_fraction}")


# (bound, strict) per field that only needs a lower bound: strict -> "must be > bound".
_LOWER_BOUNDS = {
    "batch_size": (0, True),
    "num_dense": (0, True),
    "num_sparse": (0, True),
    "max_vocab_size": (0, True),
    "zipf_alpha": (0.0, False),
    "multi_hot": (0, True),
    "num_sequences": (0, False),
    "max_sequence_length": (0, True),
    "sequence_vocab_size": (0, True),
    "teacher_latent_dim": (0, True),
    "drift": (0.0, False),
    "batches_per_day": (0, True),
    "eval_batches": (0, False),
    "prefetch": (0, False),
    "workers": (1, False),
}
