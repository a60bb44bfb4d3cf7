"""Checks of a composed run config that span its groups (the model against the data, a preset against its name,
the profiler window against the run, the data and tables against host memory): each raises a one-line ValueError
before anything is built, or names in one line a setting nothing reads. ``config.to_run_config`` calls them."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional


from loka_trainer.models.configs import MODEL_CONFIGS, PRESETS_DIR

if TYPE_CHECKING:
    from loka_trainer.config import RunConfig
    from loka_trainer.data.config import DataConfig


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


def chosen_presets(choices: Mapping[str, Any]) -> dict[str, str]:
    """``LABEL_GROUPS`` group -> its chosen preset (``precision=loka``: {"precision": "loka"}), from ``choices``,
    Hydra's ``hydra.runtime.choices`` of the composition checked (group -> option)."""
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


INDEX_BYTES = 8  # an int64 id
FLOAT_BYTES = 4  # a float32 embedding-table entry
GIB = 2**30


def ids_at_once(data: DataConfig) -> tuple[int, int]:
    """(rows, sparse ids) that one rank generates or reads in one go: a batch, or the synthetic source's teacher
    calibration sample when that is larger (it is drawn when the source starts); ids = rows x num_sparse x
    multi_hot (behaviour-sequence ids come on top)."""
    rows = data.batch_size
    if data.name == "synthetic":
        from loka_trainer.data.synthetic import CALIBRATION_ROWS  # noqa: PLC0415 -- lazy: TorchRec

        rows = max(rows, CALIBRATION_ROWS)
    return rows, rows * data.num_sparse * data.multi_hot


def host_bytes_per_id(data: DataConfig) -> int:
    """A lower bound of the host bytes each of those ids costs at the peak. Synthetic: float64 uniforms, int64 ranks
    and ids, and the teacher's (N, D) float32 vectors, D = ``data.teacher_latent_dim`` (hashed once per distinct id,
    then gathered for every id), measured (peak RSS, multi_hot 10..40, D 1..32) as 65-350 bytes, about 60 + 7.5 D;
    the bound takes 40 + 6 D, below every measurement, so that only a run that clearly cannot fit is refused.
    Criteo: the id's int64 index alone."""
    return 40 + 6 * data.teacher_latent_dim if data.name == "synthetic" else INDEX_BYTES


def cpu_table_bytes(run: RunConfig, device_type: str) -> int:
    """The float32 embedding tables (every rank's shards together) when they live in host memory (a CPU run);
    0 on a GPU."""
    if device_type != "cpu":
        return 0
    from loka_trainer.data import data_schema  # noqa: PLC0415 -- lazy: TorchRec

    schema = data_schema(run.data)
    rows = sum(schema.sparse_vocab_sizes) + sum(schema.sequence_vocab_sizes)
    return rows * run.model.embedding_dim * FLOAT_BYTES


def check_host_memory(run: RunConfig, *, device_type: str, local_ranks: int, available: Optional[int]) -> None:
    """A lower bound of the run's host memory (``local_ranks`` ranks on this host, each generating its largest batch
    of ids, plus the tables of a CPU run) fits in ``available`` bytes (None: unknown, nothing is checked); else the
    run would be killed for memory once its data starts (``data.multi_hot=1000`` at the defaults: over 17 GiB)."""
    if available is None:
        return
    data = run.data
    rows, ids = ids_at_once(data)
    per_rank = ids * host_bytes_per_id(data)
    tables = cpu_table_bytes(run, device_type)
    need = local_ranks * per_rank + tables
    if need <= available:
        return
    if tables > local_ranks * per_rank:
        lower = "data.max_vocab_size, data.sequence_vocab_size or model.embedding_dim"
    elif data.name == "criteo":
        lower = "data.batch_size"
    else:
        lower = f"data.multi_hot, data.num_sparse{', data.batch_size' * (rows == data.batch_size)} or " \
                f"data.teacher_latent_dim"
    raise ValueError(f"host memory: this run needs at least {need / GIB:.1f} GiB but {available / GIB:.1f} GiB is "
                     f"available ({local_ranks} rank(s) x {per_rank / GIB:.1f} GiB for {ids} ids generated at once: "
                     f"{rows} rows x data.num_sparse={data.num_sparse} x data.multi_hot={data.multi_hot}; embedding "
                     f"tables in host memory: {tables / GIB:.1f} GiB); lower {lower}")


def available_host_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> Optional[int]:
    """Bytes this process may take at most: ``MemAvailable`` of ``/proc/meminfo``, capped by its cgroup's memory
    limit (v2 ``memory.max``, v1 ``memory/memory.limit_in_bytes``; their usage counts page cache the kernel can
    drop, so it is not subtracted); None where neither is read."""
    found = []
    try:
        meminfo = (proc / "meminfo").read_text()
        found += [int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            found.append(int((cgroup / limit).read_text()))
        except (OSError, ValueError):  # absent, or "max" (no limit)
            pass
    return min(found) if found else None


def local_ranks() -> int:
    """Ranks on this host: torchrun's ``LOCAL_WORLD_SIZE``, 1 for a plain process."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))
