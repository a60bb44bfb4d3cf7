"""Built-in preprocessors: batch-size replication and precision (BF16 autocast; FP8 via LoKA Dispatch)."""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils import _pytree as pytree

from loka_trainer.bench.plugins import Job, Preprocessor, RunContext
from loka_trainer.bench.tree import ModuleInputs, is_leaf

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class _Unreplicable(Exception):
    """An input the replicator cannot scale along the batch (a variable-batch KJT, an object it does not know)."""


def ambiguous_batch(x: Any, batch_size: int) -> Optional[str]:
    """Why the batch of the pytree ``x`` is ambiguous, or None: a tensor with ``batch_size`` at a dim other than 0.

    The batch is dim 0 of a tensor, and a tensor is scaled when its dim 0 is ``batch_size``. A tensor such as
    (16, 16) at batch 16 (16 features, or a (T, T) mask with T = 16) or (T, B, C) also has ``batch_size`` elsewhere,
    so which of the inputs, and which of their dims, carry the batch cannot be told from their sizes.
    """
    tensors = [t for t in pytree.tree_leaves(x, is_leaf=is_leaf) if isinstance(t, torch.Tensor)]
    for t in tensors:
        dims = [d for d, n in enumerate(t.shape) if d > 0 and n == batch_size]
        if dims:
            return (f"an input of shape {tuple(t.shape)} has the batch size {batch_size} at dim {dims[0]}, not only "
                    f"at dim 0 (the batch dim), so which dims to scale is ambiguous; use a sample batch size that no "
                    f"other dim has (bench.batch_size)")
    return None


def _batch_object(leaf: Any) -> bool:
    """Whether a non-tensor leaf may carry a batch: any object with ``to`` (a KJT, a ``Batch``) but a module, a
    dtype or a device."""
    return hasattr(leaf, "to") and not isinstance(leaf, (torch.nn.Module, torch.dtype, torch.device))


def batch_size_of(x: Any) -> Optional[int]:
    """The batch size of the pytree ``x``: that of its first leaf that has one, positional before keyword, or None.

    A tensor (B, ...) has B (one of no dims has none); a KJT its stride B (a variable-batch KJT, a stride per key,
    has none); a KeyedTensor of values (B, D) B; a trainer ``Batch`` its length B -- the sizes `replicate_batch`
    scales.
    """
    for leaf in pytree.tree_leaves(x, is_leaf=is_leaf):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() > 0:
                return leaf.shape[0]
        elif _batch_object(leaf):
            if (size := _object_batch_size(leaf)) is not None:
                return size
    return None


def _object_batch_size(obj: Any) -> Optional[int]:
    """B of a KJT of stride B (not variable-batch), a key_dim-1 KeyedTensor of values (B, D) or a ``Batch``;
    None for any other object."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: PLC0415 -- torchrec is slow

    from loka_trainer.data.batch import Batch  # noqa: PLC0415 -- imports torchrec

    if isinstance(obj, KeyedJaggedTensor):
        return None if obj.variable_stride_per_key() else obj.stride()
    if isinstance(obj, KeyedTensor):
        return obj.values().shape[0] if obj.key_dim() == 1 else None
    if isinstance(obj, Batch):
        return len(obj)
    return None


@torch.no_grad()
def replicate_batch(x: Any, *, batch_size: int, factor: int) -> Any:
    """Repeat every tensor whose dim 0 equals ``batch_size`` ``factor`` times along dim 0.

    x: a pytree of tensors, (B, ...) -> (factor*B, ...); tensors of another leading size (masks, (T, T)
    buffers) are left alone. TorchRec KJTs / KeyedTensors and a trainer ``Batch`` are scaled the same way
    (`replicate_object`). A ValueError when `ambiguous_batch` finds ``batch_size`` at another dim of a tensor.
    Raises _Unreplicable for other non-tensor objects that may carry a batch (anything with a ``to``).
    """
    if (problem := ambiguous_batch(x, batch_size)) is not None:
        raise ValueError(problem)

    def rep(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() > 0 and leaf.shape[0] == batch_size:
                return leaf.repeat(factor, *([1] * (leaf.dim() - 1)))
            return leaf
        if _batch_object(leaf):
            return replicate_object(leaf, batch_size=batch_size, factor=factor)
        return leaf

    return pytree.tree_map(rep, x, is_leaf=is_leaf)


def replicate_object(obj: Any, *, batch_size: int, factor: int) -> Any:
    """``obj`` (a TorchRec KJT or KeyedTensor, or a trainer ``Batch``) with its batch repeated ``factor`` times.

    KJT of stride B = ``batch_size``: `replicate_kjt`; a KJT of another stride is left alone (as a tensor of
    another leading size). KeyedTensor: values (B, D) -> (factor*B, D). Batch: every field through
    `replicate_batch` (dense (B, F_d), labels (B,), sparse / sequences KJTs of stride B), so they stay consistent.
    Raises _Unreplicable for any other object, and a ValueError as `replicate_batch` does.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: PLC0415 -- torchrec is slow

    from loka_trainer.data.batch import Batch  # noqa: PLC0415 -- imports torchrec

    if isinstance(obj, KeyedJaggedTensor):
        return replicate_kjt(obj, factor) if obj.stride() == batch_size else obj
    if isinstance(obj, KeyedTensor):
        if obj.key_dim() != 1:
            raise _Unreplicable(f"KeyedTensor (key_dim {obj.key_dim()})")
        values = replicate_batch(obj.values(), batch_size=batch_size, factor=factor)
        return KeyedTensor(keys=obj.keys(), length_per_key=obj.length_per_key(), values=values, key_dim=1)
    if isinstance(obj, Batch):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **replicate_batch(fields, batch_size=batch_size, factor=factor))
    raise _Unreplicable(type(obj).__name__)


def replicate_kjt(kjt: KeyedJaggedTensor, factor: int) -> KeyedJaggedTensor:
    """A KeyedJaggedTensor of stride B -> one of stride ``factor``*B whose rows are the original's ``factor`` times.

    Per key, lengths (B,) -> (factor*B,) and values / weights (L_k,) -> (factor*L_k,), so row r of the result is
    row r mod B of ``kjt``. Raises _Unreplicable for a variable-batch KJT (a stride per key).
    """
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor  # noqa: PLC0415 -- torchrec is slow

    if kjt.variable_stride_per_key():
        raise _Unreplicable("variable-batch KeyedJaggedTensor")
    if not kjt.keys():
        return KeyedJaggedTensor(keys=[], values=kjt.values(), lengths=kjt.lengths(), stride=factor * kjt.stride())

    def rep(jt: JaggedTensor) -> JaggedTensor:
        weights = jt.weights_or_none()
        return JaggedTensor(values=jt.values().repeat(factor), lengths=jt.lengths().repeat(factor),
                            weights=None if weights is None else weights.repeat(factor))

    return KeyedJaggedTensor.from_jt_dict({key: rep(jt) for key, jt in kjt.to_dict().items()})


class BatchReplicate(Preprocessor):
    """Scale a captured (small) batch back up by ``factor`` along dim 0 (paper III-B1), KJTs and Batches included
    (`replicate_object`); inputs it cannot scale (a variable-batch KJT) run as captured, inputs whose batch dim is
    ambiguous (`ambiguous_batch`) fail the module (ValueError)."""

    name = "batch_replicate"

    def __init__(self, factor: int = 1) -> None:
        if factor < 1:
            raise ValueError(f"bench.replicate must be >= 1, got {factor}")
        self.factor = factor

    def apply(self, job: Job, ctx: RunContext) -> Job:
        if self.factor == 1:
            return job
        if job.batch_size is None:
            note = "batch replication needs the inputs' batch size (no input tensor has one); ran as captured"
            return dataclasses.replace(job, notes=job.notes + [note])
        try:
            args, kwargs = replicate_batch((job.inputs.args, job.inputs.kwargs), batch_size=job.batch_size,
                                           factor=self.factor)
        except _Unreplicable as err:
            note = f"batch replication unsupported for {err} input; ran at the captured batch {job.batch_size}"
            return dataclasses.replace(job, notes=job.notes + [note])
        return dataclasses.replace(job, inputs=ModuleInputs(args, kwargs), batch_size=job.batch_size * self.factor)


def _autocast(device_type: str, dtype: torch.dtype) -> Any:
    return torch.autocast(device_type=device_type, dtype=dtype)


class Precision(Preprocessor):
    """Run each submodule in a precision: ``fp32`` (as built), ``bf16`` (autocast), ``fp8`` (LoKA Dispatch)."""

    name = "precision"
    MODES = ("fp32", "bf16", "fp8")

    def __init__(self, mode: str = "fp32") -> None:
        if mode not in self.MODES:
            raise ValueError(f"bench.precision={mode!r} is unknown; valid values: {list(self.MODES)}")
        self.mode = mode

    def apply(self, job: Job, ctx: RunContext) -> Job:
        if self.mode == "fp32":
            return job
        factory = functools.partial(_autocast, ctx.device.type, torch.bfloat16)
        job = dataclasses.replace(job, contexts=job.contexts + [factory])
        return job if self.mode == "bf16" else _with_dispatch(job, ctx.device)


class _ReplayCaptured(torch.nn.Module):
    """Wraps a submodule so that Dispatch's one-argument calibration forward replays its captured inputs."""

    def __init__(self, inner: torch.nn.Module, inputs: ModuleInputs) -> None:
        super().__init__()
        self.inner, self.inputs = inner, inputs

    def forward(self, _: Any) -> Any:
        return self.inputs.call(self.inner)


def _with_dispatch(job: Job, device: torch.device) -> Job:
    """A deep copy of the submodule under LoKA Dispatch (plan measured here, on its captured inputs), BF16 around.

    The model being profiled is never modified: each submodule gets its own converted copy.
    """
    from loka_trainer.dispatch.plan_table import num_fp8_gemms
    from loka_trainer.precision import PrecisionConfig, apply_precision

    wrapper = _ReplayCaptured(copy.deepcopy(job.module), job.inputs)
    config = PrecisionConfig(name="loka", compute_dtype="bfloat16", dispatch=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        plan = apply_precision(wrapper, config=config, device=device, calibration_batch=job.inputs,
                              log=lambda _: None)
    num_gemms = 3 * len(plan.layers) if plan else 0
    note = f"LoKA Dispatch: {num_fp8_gemms(plan) if plan else 0} of {num_gemms} GEMMs in FP8"
    return dataclasses.replace(job, module=wrapper.inner, notes=job.notes + [note])


def compute_dtype(mode: str, device: torch.device) -> str:
    """The dtype whose peak an MFU is measured against: fp32 matmuls count as TF32 only when TF32 is on."""
    if mode != "fp32":
        return mode
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


PREPROCESSORS: dict[str, type[Preprocessor]] = {
    "batch_replicate": BatchReplicate,
    "precision": Precision,
}
