"""Config schemas of the zoo's models (Hydra structured configs), apart from the modules so that validating a
command line imports neither TorchRec nor the models. ``MODEL_CONFIGS`` is keyed like ``zoo.MODELS``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, List

from omegaconf import DictConfig, OmegaConf

from loka_trainer.models.mods import ModsConfig
from loka_trainer.sharding.config import check_embedding_columns

# Size fields of the zoo's configs that may be 0 (a model without that part); every other int field is a count or
# width that must be >= 1, and so must each entry of a list of widths (a zero-sized weight breaks FSDP2 and
# the embedding kernels, a negative one torch).
ZERO_ALLOWED = ("cross_layers",)


def check_sizes(config: Any) -> None:
    """A one-line ``ValueError`` naming the first int field of the model ``config`` (a dataclass) below its least
    value, or a list of widths with an entry below 1."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            least = 0 if field.name in ZERO_ALLOWED else 1
            if value < least:
                raise ValueError(f"model.{field.name} must be >= {least}, got {value}")
        elif isinstance(value, list) and any(isinstance(w, int) and w < 1 for w in value):
            raise ValueError(f"model.{field.name} must list widths >= 1, got {list(value)}")


def check_model_config(config: Any) -> None:
    """The checks of a model config that need no data schema: sizes, then the embedding width the sharded tables
    take (the builders check what depends on the data, e.g. InterFormer's recent tokens)."""
    check_sizes(config)
    check_embedding_columns(config.embedding_dim)


@dataclasses.dataclass
class DLRMConfig:
    """Hydra schema ``model=dlrm``. ``dense_arch_widths[-1]`` must equal ``embedding_dim``."""

    name: str = "dlrm"
    embedding_dim: int = 128
    dense_arch_widths: List[int] = dataclasses.field(default_factory=lambda: [512, 256, 128])
    over_arch_widths: List[int] = dataclasses.field(default_factory=lambda: [1024, 1024, 512, 256])
    mods: ModsConfig = dataclasses.field(default_factory=ModsConfig)

    def validate(self) -> None:
        check_model_config(self)


@dataclasses.dataclass
class DLRMDCNv2Config(DLRMConfig):
    """Hydra schema ``model=dlrm_dcnv2``: DLRM with a low-rank DCNv2 cross net as interaction."""

    name: str = "dlrm_dcnv2"
    cross_layers: int = 3
    cross_rank: int = 512


@dataclasses.dataclass
class WukongConfig:
    """Hydra schema ``model=wukong``; defaults are paper-like (d=128, 3 layers, n_F=n_L=16, k=24)."""

    name: str = "wukong"
    embedding_dim: int = 128
    num_dense_embeddings: int = 4
    dense_arch_widths: List[int] = dataclasses.field(default_factory=lambda: [512])
    num_layers: int = 3
    num_fm_embeddings: int = 16
    num_lc_embeddings: int = 16
    fm_rank: int = 24
    fmb_widths: List[int] = dataclasses.field(default_factory=lambda: [512, 512])
    over_arch_widths: List[int] = dataclasses.field(default_factory=lambda: [512, 512])
    mods: ModsConfig = dataclasses.field(default_factory=ModsConfig)

    def validate(self) -> None:
        check_model_config(self)


def interformer_mods() -> ModsConfig:
    """InterFormer's Mods default: under the no-bias Mod the sequence merge Linear keeps an ``nn.Linear``-drawn bias.

    Why (docs/results/interformer_mods_cpu, BF16 + all three Mods, 300 steps, eval RLL vs the published model):
    bias-free everywhere costs +0.52%; a bias drawn like ``nn.Linear``'s on ``input_arch.merge`` alone brings it
    back to the seed noise (-0.05 +- 0.09%, 3 seeds); a zero-initialised one there does not (+0.69%, seed 0), nor do
    nn.Linear-drawn biases in any other sub-arch (+0.32 to +0.54%, seed 0). TorchRec's embedding
    init is tiny (+-1/sqrt(vocab)), so a bias-free merge makes sequence tokens tiny random vectors that the
    Sequence Arch's norms blow up to unit size; the bias (one D-vector, ``(We + b) * valid``) is a learned
    "an item is here" embedding that dominates at the start. One small GEMM (F_q*D -> D) keeps a bias; every
    GEMM inside the InterFormer layers stays bias-free. Under the published Mods (biases on) this is a no-op.
    """
    return ModsConfig(keep_bias=["input_arch.merge"], keep_bias_init="linear")


@dataclasses.dataclass
class InterFormerConfig:
    """Hydra schema ``model=interformer``; defaults are paper-like, ``conf/model/interformer.yaml`` is CPU-sized."""

    name: str = "interformer"
    # Behaviour-sequence features the data must provide; conf/data/synthetic.yaml reads this value
    # (`data.num_sequences: ${oc.select:model.num_sequences,0}`), so `model=interformer` needs no data override.
    num_sequences: int = 2
    embedding_dim: int = 128
    num_dense_embeddings: int = 4
    dense_arch_widths: List[int] = dataclasses.field(default_factory=lambda: [512])
    num_layers: int = 3
    num_heads: int = 4
    interaction: str = "dcnv2"
    interaction_widths: List[int] = dataclasses.field(default_factory=lambda: [1024])
    cross_layers: int = 2
    cross_rank: int = 256
    num_summary_embeddings: int = 8
    num_cls_tokens: int = 4
    num_pma_seeds: int = 2
    num_recent_tokens: int = 4
    pffn_widths: List[int] = dataclasses.field(default_factory=lambda: [256])
    over_arch_widths: List[int] = dataclasses.field(default_factory=lambda: [512, 256])
    mods: ModsConfig = dataclasses.field(default_factory=interformer_mods)

    def validate(self) -> None:
        check_model_config(self)


MODEL_CONFIGS: dict[str, type] = {
    "dlrm": DLRMConfig,
    "dlrm_dcnv2": DLRMDCNv2Config,
    "wukong": WukongConfig,
    "interformer": InterFormerConfig,
}

PRESETS_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"


def preset_model_node(preset: DictConfig) -> DictConfig:
    """The model node of a loaded ``conf/model`` file. A preset that also sets other groups' defaults (a
    ``# @package _global_`` file: ``interformer_h200`` sets ``trainer.warmup_steps``) nests it under ``model``;
    ``defaults`` (the schema it names, ``/<model>_schema``, is the class ``MODEL_CONFIGS[node.name]``) is dropped."""
    node = preset.model if "model" in preset else preset
    node.pop("defaults", None)
    return node


def preset_config(name: str, presets_dir: Path = PRESETS_DIR):
    """``conf/model/<name>.yaml`` (what ``train.py model=<name>`` trains: ``wukong`` the CPU size, ``wukong_h200``
    the GPU scale) merged onto its schema, which the file's ``name`` picks; raises a one-line ValueError."""
    path = presets_dir / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in presets_dir.glob("*.yaml"))
        raise ValueError(f"model preset {name!r}: no {path.name} in {presets_dir}; known: {known}")
    raw = preset_model_node(OmegaConf.load(path))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MODEL_CONFIGS[raw.name]), raw))
