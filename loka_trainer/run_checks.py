"""Checks of a composed run config that span its groups (the model against the data, a preset against its name,
the profiler window against the run): each raises a one-line ValueError before anything is built, or names in one
line a setting nothing reads. ``config.to_run_config`` calls them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from hydra.core.hydra_config import HydraConfig

from loka_trainer.models.configs import MODEL_CONFIGS, PRESETS_DIR

if TYPE_CHECKING:
    from loka_trainer.config import RunConfig


def preset_choice(group: str, name: str) -> str:
    """How to pick ``name`` in Hydra's ``group``: ``group=name`` when it is a preset there, else the presets."""
    presets = sorted(p.stem for p in (PRESETS_DIR.parent / group).glob("*.yaml"))
    return f"{group}={name}" if name in presets else f"{group}=<preset>, one of {', '.join(presets)}"


def check_model_name(model: Any) -> None:
    """``model.name`` is the model of the preset's schema: it does not pick another model (``model=<preset>`` does),
    and another model's name would build that model from this one's config, or fail in the builder."""
    schema = type(model)
    owner = next((name for name, cls in MODEL_CONFIGS.items() if cls is schema), None)
    if owner is not None and model.name != owner:
        choose = preset_choice("model", model.name)
        raise ValueError(f"model.name={model.name!r} does not pick the model: this preset's schema is {owner!r} "
                         f"(model.name must stay {owner!r}); choose a model with {choose}")


LABEL_GROUPS = ("precision", "sharding")  # groups whose ``name`` only labels the run: the chosen preset's own


def chosen_presets() -> dict[str, str]:
    """``LABEL_GROUPS`` group -> the preset Hydra composed (``precision=loka``: {"precision": "loka"}), from the
    config Hydra composed last; empty when Hydra composed none."""
    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {group: str(choices[group]) for group in LABEL_GROUPS if choices.get(group) is not None}


def check_preset_names(run: RunConfig, chosen: dict[str, str]) -> None:
    """``precision.name`` / ``sharding.name`` label the run (summary.json, train.log) and pick nothing: another name
    would run the chosen preset under it. Each stays its preset's own (``chosen``: group -> preset)."""
    for group, preset in chosen.items():
        name = getattr(run, group).name
        if name != preset:
            choose = preset_choice(group, name)
            raise ValueError(f"{group}.name={name!r} does not pick the {group}: it labels the run and stays the "
                             f"preset's own ({group}.name must stay {preset!r} under {group}={preset}); choose "
                             f"one with {choose}")


def check_data_has_the_model_sequences(run: RunConfig) -> None:
    """A model that reads behaviour sequences (``model.num_sequences`` > 0) gets data with that many; the model's own
    check would otherwise fail on a derived setting (``model.num_recent_tokens``) and not say why, and the model
    is built for as many as the data provides, whatever ``model.num_sequences`` says."""
    wanted = getattr(run.model, "num_sequences", 0)
    if wanted > 0 and run.data.num_sequences == 0:
        why = ("Criteo TSV has no sequence columns: train it on data=synthetic" if run.data.name == "criteo"
               else "set data.num_sequences > 0 or leave it unset (it follows model.num_sequences)")
        raise ValueError(f"model={run.model.name} reads behaviour sequences (model.num_sequences={wanted}) but "
                         f"data={run.data.name} provides none (data.num_sequences=0); {why}")
    if wanted > 0 and run.data.num_sequences != wanted:  # the model is built for every sequence the data has
        raise ValueError(f"model.num_sequences={wanted} but data.num_sequences={run.data.num_sequences}: "
                         f"model={run.model.name} reads every sequence the data provides, so one of them would be "
                         f"overruled; set model.num_sequences={run.data.num_sequences} and leave data.num_sequences "
                         f"unset (it follows model.num_sequences)")


def unread_sequences(run: RunConfig) -> Optional[str]:
    """A line for train.log when the data has behaviour sequences and the model reads none (DLRM, Wukong): they
    are generated, and the planted teacher's labels depend on them, but the model never sees them."""
    if run.data.num_sequences > 0 and not hasattr(run.model, "num_sequences"):
        return (f"model={run.model.name} does not read behaviour sequences: the data's data.num_sequences="
                f"{run.data.num_sequences} are generated (and shape its labels) but never seen by the model")
    return None


def check_profiler_window(run: RunConfig) -> None:
    """An enabled profiler's steps lie inside the run (else it profiles nothing, or stops mid-window, silently)."""
    p, steps = run.callbacks.profiler, run.trainer.steps
    if p.enabled and p.start_step + p.num_steps > steps:
        raise ValueError(f"callbacks.profiler: steps {p.start_step}..{p.start_step + p.num_steps - 1} are not all "
                         f"inside the run (steps 0..{steps - 1}, trainer.steps={steps}); lower "
                         f"callbacks.profiler.start_step or num_steps")
