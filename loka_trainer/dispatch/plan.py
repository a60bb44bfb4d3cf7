"""The Dispatch plan: layer FQN -> backend per GEMM, with the evidence (MERE, timings) behind each choice.

A plan is a JSON file a user can read, edit by hand (change ``"backend"``), check in and reuse. Layout::

    {"version": 1, "device": "NVIDIA H200", "mere_threshold": 0.2, "min_speedup": 1.05,
     "max_flushed_fraction": 0.01,
     "layers": {"dense.mlp.0": {"shape": {"M": 4096, "K": 512, "N": 1024},
                                "forward": {"backend": "scaled_mm_rowwise", "mere": 0.031, "flushed": 0.0,
                                            "time_us": 12.0, "bf16_time_us": 15.1,
                                            "candidates": {"scaled_mm_rowwise": {"mere": 0.031, "flushed": 0.0,
                                                                                 "time_us": 12.0},
                                                           "scaled_mm_tensorwise": {"mere": 0.02, "flushed": 0.84,
                                                                                    "time_us": 11.0}}},
                                "input_grad": {...}, "weight_grad": {...}}}}

Only ``backend`` is required per GEMM; the rest is evidence (null when unknown). ``flushed`` is the largest fraction
of a real operand's (x, W) nonzero values that the backend's FP8 cast sets to zero (``probe.flush``); a candidate
above ``max_flushed_fraction`` was rejected for it (``rejected_for_flush``; above, ``scaled_mm_tensorwise``).

A layer that LoKA fuses with its BlockNorm and HardSwish (``mods.module.FusedLinearMods``) may also carry
``"mods_forward": {"mode": "split_fp8", "times_us": {"fused_bf16": 120.0, ...}}``: the forward kernel whose
layer trained fastest (µs of a whole step in each mode, ``mods.modes.FORWARD_MODES``; ``plain``, the PyTorch
math, only in a plan for a compiled model); without it the mode follows the forward backend (FP8 or not) and,
for BF16, whether the model is compiled. And
``"mods_input_grad": {"mode": "scaled_mm_rowwise", "times_us": {"bf16": 82.6, "scaled_mm_rowwise": 77.6}}``:
the input-grad backend the fused layer runs, chosen by timing the whole layer (forward + backward, µs) with
each accurate candidate, because inside the layer an FP8 dgrad's quantization of dz is fused into the dz kernel
(``mods.ops.FUSED_DGRAD``) and so costs less than the GEMM timed alone says; it replaces ``input_grad``'s
backend for that layer.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from loka_trainer.atomic_files import atomic_write_text
from loka_trainer.dispatch.targets import excluded
from loka_trainer.kernels.backend_base import GEMMS
from loka_trainer.kernels.backends import BACKENDS, BASELINE
from loka_trainer.mods.modes import FORWARD_MODES
from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION

PLAN_VERSION = 1


def gemm_is_fp8(backend: str, gemm: str) -> bool:
    """True if backend ``backend`` runs ``gemm`` in FP8 (``GemmBackend.is_fp8``): e.g. not the weight grad of
    ``torchao_rowwise_with_gw_hp``, which is bitwise the BF16 one. A name outside the registry (rejected by
    ``validate_plan``) counts as FP8 unless it is ``bf16``."""
    known = BACKENDS.get(backend)
    return known.is_fp8(gemm) if known is not None else backend != BASELINE


def gemm_label(backend: str, gemm: str) -> str:
    """How tables and logs name a GEMM's backend: ``bf16 (via NAME)`` when NAME runs that GEMM in BF16."""
    if backend == BASELINE or gemm_is_fp8(backend, gemm):
        return backend
    return f"{BASELINE} (via {backend})"
MODS_CHOICES = ("mods_forward", "mods_input_grad")  # the optional per-layer ModsChoice fields


@dataclasses.dataclass
class GemmChoice:
    """The backend chosen for one GEMM of one layer, and why (``mere``/times are None when not measured)."""

    backend: str = "bf16"
    mere: Optional[float] = None
    flushed: Optional[float] = None  # the chosen backend's flushed fraction of the real operands (``probe.flush``)
    time_us: Optional[float] = None
    bf16_time_us: Optional[float] = None
    candidates: dict[str, dict[str, Optional[float]]] = dataclasses.field(default_factory=dict)

    def candidate_mere(self, name: str) -> Optional[float]:
        """The measured MERE of candidate backend ``name`` (None when it was not measured)."""
        return (self.candidates.get(name) or {}).get("mere")

    @property
    def speedup(self) -> Optional[float]:
        if self.time_us is None or self.bf16_time_us is None or self.time_us <= 0:
            return None
        return self.bf16_time_us / self.time_us


@dataclasses.dataclass
class ModsChoice:
    """What a fused Linear -> BlockNorm -> HardSwish layer runs, chosen by timing it: its forward kernel
    (``mods_forward``: a ``FORWARD_MODES`` name) or its input-grad backend (``mods_input_grad``: a backend name),
    the times (µs) behind the choice and its speedup over the fastest BF16 option."""

    mode: str
    times_us: dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    speedup: Optional[float] = None


@dataclasses.dataclass
class LayerPlan:
    """One Linear: its shape (M the calibration batch rows, K in, N out) and a choice per GEMM."""

    M: int
    K: int
    N: int
    forward: GemmChoice = dataclasses.field(default_factory=GemmChoice)
    input_grad: GemmChoice = dataclasses.field(default_factory=GemmChoice)
    weight_grad: GemmChoice = dataclasses.field(default_factory=GemmChoice)
    mods_forward: Optional[ModsChoice] = None
    mods_input_grad: Optional[ModsChoice] = None

    def backends(self) -> dict[str, str]:
        """GEMM name -> backend name."""
        return {g: getattr(self, g).backend for g in GEMMS}

    def runs_fp8(self) -> dict[str, bool]:
        """GEMM name -> whether it runs in FP8: its backend runs that GEMM in FP8 (``gemm_is_fp8``; a
        high-precision GEMM of an FP8 recipe is BF16), except that a fused Mods layer's forward runs in its
        recorded mode (``mods_forward``), which stays BF16 when a BF16 mode was timed faster, and its input grad
        on the recorded ``mods_input_grad`` backend."""
        fp8 = {g: gemm_is_fp8(b, g) for g, b in self.backends().items()}
        if self.mods_forward is not None:
            fp8["forward"] = fp8["forward"] and FORWARD_MODES[self.mods_forward.mode].fp8
        if self.mods_input_grad is not None:
            fp8["input_grad"] = gemm_is_fp8(self.mods_input_grad.mode, "input_grad")
        return fp8


@dataclasses.dataclass
class DispatchPlan:
    device: str
    layers: dict[str, LayerPlan]
    mere_threshold: float = 0.2
    min_speedup: float = 1.05
    max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION
    version: int = PLAN_VERSION

    def to_dict(self) -> dict[str, Any]:
        layers = {}
        for fqn, lp in self.layers.items():
            entry: dict[str, Any] = {"shape": {"M": lp.M, "K": lp.K, "N": lp.N}}
            entry.update({g: dataclasses.asdict(getattr(lp, g)) for g in GEMMS})
            for key in MODS_CHOICES:
                if getattr(lp, key) is not None:
                    entry[key] = dataclasses.asdict(getattr(lp, key))
            layers[fqn] = entry
        return {"version": self.version, "device": self.device, "mere_threshold": self.mere_threshold,
                "min_speedup": self.min_speedup, "max_flushed_fraction": self.max_flushed_fraction, "layers": layers}

    def save(self, path: str | Path) -> Path:
        """Write the plan to ``path`` as JSON (atomically), the file ``LoKAConfig(plan=path)`` reuses; returns it."""
        return save_plan(self, path)

    @classmethod
    def load(cls, path: str | Path) -> "DispatchPlan":
        """The plan in the JSON file ``path`` (``save``'s, or a run's ``dispatch_plan.json``); a missing, unreadable
        or damaged file -> a one-line ValueError naming the file and the first bad field."""
        return load_plan(path, where="DispatchPlan.load")

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> "DispatchPlan":
        """The plan held by ``d`` (parsed JSON); a one-line ValueError naming ``source`` and the first bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: must be a JSON object with 'version' and 'layers', got {type(d).__name__}")
        if type(d.get("version")) is not int or d["version"] != PLAN_VERSION:
            raise ValueError(f"{source}: version must be {PLAN_VERSION}, got {d.get('version')!r}")
        if not isinstance(d.get("layers"), dict):
            raise ValueError(f"{source}: 'layers' must be an object mapping layer FQN -> entry")
        layers = {fqn: _layer_from_dict(e, where=f"{source}: layer {fqn!r}") for fqn, e in d["layers"].items()}
        settings = {key: _number(d.get(key, default), where=f"{source}: {key!r}")
                    for key, default in (("mere_threshold", 0.2), ("min_speedup", 1.05),
                                         ("max_flushed_fraction", DEFAULT_MAX_FLUSHED_FRACTION))}
        for key, (valid, what) in PLAN_SETTINGS.items():
            if not valid(settings[key]):
                raise ValueError(f"{source}: {key!r} must be {what}, got {settings[key]!r}")
        for fqn, lp in layers.items():
            for g in GEMMS:
                choice = getattr(lp, g)
                if choice.backend != BASELINE and choice.mere is not None and not math.isfinite(choice.mere):
                    raise ValueError(f"{source}: layer {fqn!r}: {g!r} runs {choice.backend} with MERE "
                                     f"{choice.mere}: a damaged plan (no FP8 choice passes a non-finite error)")
        return cls(device=str(d.get("device", "unknown")), layers=layers, **settings)


# a plan's selection settings -> (valid, what they must be); LoKAConfig.validate checks its own with them, so
# that a plan measured under any accepted setting loads again
PLAN_SETTINGS = {
    "mere_threshold": (lambda v: 0.0 < v < math.inf, "a finite number > 0"),
    "min_speedup": (lambda v: 0.0 < v < math.inf, "a finite number > 0"),
    "max_flushed_fraction": (lambda v: 0.0 <= v <= 1.0, "within [0, 1]"),
}


def _number(v: Any, *, where: str, optional: bool = False) -> Optional[float]:
    """``v`` as a float (None allowed when ``optional``); a ValueError naming ``where`` for anything else."""
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where} must be a number{' or null' if optional else ''}, got {v!r}")
    return float(v)


def _numbers(m: Any, *, where: str) -> dict[str, Optional[float]]:
    """A JSON object of name -> number or null (times, a candidate's evidence)."""
    if m is None:
        return {}
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object of numbers, got {m!r}")
    return {str(k): _number(v, where=f"{where} {k!r}", optional=True) for k, v in m.items()}


def _evidence(m: Any, *, where: str) -> dict[str, Any]:
    """A candidate's evidence: name -> number or null, and ``times_us``: its time in each timing round."""
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object of numbers, got {m!r}")
    out: dict[str, Any] = _numbers({k: v for k, v in m.items() if k != "times_us"}, where=where)
    if "times_us" in m:
        rounds = m["times_us"]
        if not isinstance(rounds, list):
            raise ValueError(f"{where} 'times_us' must be a list of numbers, got {rounds!r}")
        out["times_us"] = [_number(v, where=f"{where} 'times_us'") for v in rounds]
    return out


def _gemm_from_dict(c: Any, *, where: str) -> GemmChoice:
    if not isinstance(c, dict) or not isinstance(c.get("backend"), str):
        raise ValueError(f"{where} needs a string 'backend' (valid GEMMs: {list(GEMMS)})")
    candidates = c.get("candidates") or {}
    if not isinstance(candidates, dict):
        raise ValueError(f"{where} 'candidates' must be an object of backend -> evidence, got {candidates!r}")
    return GemmChoice(backend=c["backend"],
                      **{k: _number(c.get(k), where=f"{where} {k!r}", optional=True)
                         for k in ("mere", "flushed", "time_us", "bf16_time_us")},
                      candidates={str(name): _evidence(ev, where=f"{where} candidate {name!r}")
                                  for name, ev in candidates.items()})


def _layer_from_dict(e: Any, *, where: str) -> LayerPlan:
    if not isinstance(e, dict) or not isinstance(e.get("shape"), dict):
        raise ValueError(f"{where}: needs a 'shape' object with M, K, N")
    shape = e["shape"]
    if not all(type(shape.get(k)) is int and shape[k] > 0 for k in ("M", "K", "N")):
        raise ValueError(f"{where}: 'shape' needs integer M, K, N, got {shape!r}")
    choices = {g: _gemm_from_dict(e.get(g, {"backend": "bf16"}), where=f"{where}: '{g}'") for g in GEMMS}
    mods = {}
    for key in MODS_CHOICES:
        m = e.get(key)
        if m is not None:
            if not isinstance(m, dict) or not isinstance(m.get("mode"), str):
                raise ValueError(f"{where}: '{key}' needs a string 'mode'")
            mods[key] = ModsChoice(mode=m["mode"],
                                   times_us=_numbers(m.get("times_us"), where=f"{where}: '{key}' times_us"),
                                   speedup=_number(m.get("speedup"), where=f"{where}: '{key}' speedup", optional=True))
    return LayerPlan(M=shape["M"], K=shape["K"], N=shape["N"], **mods, **choices)


def save_plan(plan: DispatchPlan, path: str | Path) -> Path:
    """Write the plan as indented JSON (atomically: write then rename) and return the path."""
    return atomic_write_text(Path(path), json.dumps(plan.to_dict(), indent=2, sort_keys=False) + "\n")


def without_excluded(plan: DispatchPlan, exclude: Optional[Sequence[str]]) -> DispatchPlan:
    """``plan`` minus the layers an ``exclude`` glob names: they run BF16, as every layer a plan does not name."""
    return dataclasses.replace(plan, layers={fqn: lp for fqn, lp in plan.layers.items() if not excluded(fqn, exclude)})


def load_plan(path: str | Path, *, where: str = "precision.plan") -> DispatchPlan:
    """Read a plan file; a missing file or malformed content -> one-line ValueError naming ``where`` (the setting
    that named the file) and the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{where}: file {str(path)!r} does not exist")
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: {str(path)!r} is not UTF-8 text, so not a plan file ({e.reason} at "
                         f"byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: {str(path)!r} is not valid JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot read {str(path)!r} ({e.strerror})") from None
    return DispatchPlan.from_dict(d, source=f"{where} {str(path)!r}")


def validate_plan(plan: DispatchPlan, layer_shapes: dict[str, tuple[int, int]], valid_backends: list[str],
                  mods_modes: Optional[dict[str, bool]] = None, *, source: str = "plan") -> None:
    """Check a plan against a model: layer_shapes maps FQN -> (K, N) of each target Linear; ``mods_modes`` maps
    each fused-layer forward mode to whether it is FP8.

    Rejects (one-line ValueError): a layer the model does not have, a K/N that differs from the model's, a
    backend name not in ``valid_backends``, a Mods forward mode not in ``mods_modes``, an FP8 one on a layer
    whose forward GEMM is BF16 (no FP8 candidate passed the accuracy test there) or ``plain`` on a layer with an
    FP8 backward GEMM, a Mods input-grad backend not in ``valid_backends`` or one whose measured input-grad MERE
    is not below the plan's threshold or whose flushed fraction exceeds the plan's ``max_flushed_fraction``.
    Layers of the model missing from the plan are allowed (they stay BF16) so a plan can be trimmed by hand.
    ``source`` names the plan in the messages.
    """
    for fqn, lp in plan.layers.items():
        if fqn not in layer_shapes:
            raise ValueError(f"{source}: unknown layer {fqn!r}, not a target of this model (a plan of another model "
                             f"or config?); model layers: {sorted(layer_shapes)}")
        if (lp.K, lp.N) != tuple(layer_shapes[fqn]):
            raise ValueError(f"{source}: layer {fqn!r} has shape K={lp.K}, N={lp.N} but the model's is "
                             f"K={layer_shapes[fqn][0]}, N={layer_shapes[fqn][1]} (a plan of another model or "
                             f"config?)")
        for g, name in lp.backends().items():
            if name not in valid_backends:
                raise ValueError(f"{source}: layer {fqn!r} {g}: backend {name!r} is unknown or unavailable on this "
                                 f"device; valid: {sorted(valid_backends)}")
        if lp.mods_forward is not None and mods_modes is not None:
            mode = lp.mods_forward.mode
            if mode not in mods_modes:
                raise ValueError(f"{source}: layer {fqn!r} mods_forward: unknown mode {mode!r}; "
                                 f"valid: {sorted(mods_modes)}")
            if mods_modes[mode] and lp.forward.backend == "bf16":
                raise ValueError(f"{source}: layer {fqn!r} mods_forward: FP8 mode {mode!r} but the forward GEMM is bf16 "
                                 f"(no FP8 kernel was accurate enough there)")
            dgrad = lp.mods_input_grad.mode if lp.mods_input_grad is not None else lp.input_grad.backend
            if not FORWARD_MODES[mode].takes_backward(dgrad, lp.weight_grad.backend):
                raise ValueError(f"{source}: layer {fqn!r} mods_forward: mode {mode!r} runs bf16 backward GEMMs, "
                                 f"but the plan has input_grad {dgrad!r}, weight_grad {lp.weight_grad.backend!r}")
        if lp.mods_input_grad is not None:
            name = lp.mods_input_grad.mode
            if name not in valid_backends:
                raise ValueError(f"{source}: layer {fqn!r} mods_input_grad: backend {name!r} is unknown or unavailable "
                                 f"on this device; valid: {sorted(valid_backends)}")
            err = lp.input_grad.candidate_mere(name)
            if name != "bf16" and err is not None and err >= plan.mere_threshold:
                raise ValueError(f"{source}: layer {fqn!r} mods_input_grad: {name!r} has input-grad MERE {err:.4g} >= "
                                 f"{plan.mere_threshold} (not accurate enough there)")
            flushed = (lp.input_grad.candidates.get(name) or {}).get("flushed")
            if name != "bf16" and flushed is not None and flushed > plan.max_flushed_fraction:
                raise ValueError(f"{source}: layer {fqn!r} mods_input_grad: {name!r} flushes {flushed:.4g} of an "
                                 f"operand's nonzeros to zero, > max_flushed_fraction {plan.max_flushed_fraction}")
