"""The model transforms of the Mods: put LoKA's Mods into a user's model (``apply_mods``), fuse each
Linear -> BlockNorm -> HardSwish triple into one ``FusedLinearMods`` (``fuse_linear_mods``) and chain the FP8
handoff between fused layers (``chain_fp8_handoffs``).

``layers.mlp`` builds ``nn.Sequential(Linear, norm, activation, ...)`` with stable child indices. With the
Mods on (no bias, ``BlockNorm`` without affine, ``HardSwish``) each triple is one fusable layer:
``fuse_linear_mods`` puts a ``FusedLinearMods`` at the Linear's index (same ``weight`` Parameter object, so
optimizer / FSDP state stay valid and the state_dict keys are unchanged: ``mlp.0.weight``) and
``nn.Identity`` at the norm and activation indices (they hold no parameters or buffers).

FP8 handoff (``chain_fp8_handoffs``): when a FusedLinearMods feeds the next one directly (only ``nn.Identity``
between them in one ``nn.Sequential``) and that one's forward is FP8, the first one's epilogue also writes its
output in e4m3 at the static scale fp8_max / sqrt(B) (BlockNorm bounds it, see ``mods.reference``) and the second
uses it instead of quantizing its input: one pass over the activation and one kernel launch less per pair. The
handoff is eager-only (under ``torch.compile`` each layer quantizes its own input, which inductor schedules),
and only from a layer whose forward mode is split (cuBLAS + the epilogue kernel): in the H200 MLP-stack
profile the extra FP8 store made the single fused GEMM+epilogue kernel 29 µs slower at batch 4096 (3 layers)
against 17 µs of quantization saved, while the split epilogue kernel paid 8 µs for it (docs/kernels/README.md).
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn
from torch.nn.utils import parametrize

from loka_trainer.module_hooks import ALL_HOOKS, OUTPUT_HOOKS, STATE_DICT_HOOKS, carry_hooks, held_hooks
from loka_trainer.module_names import canonical_named_modules
from loka_trainer.mods import shapes
from loka_trainer.mods.layers import BlockNorm, HardSwish
from loka_trainer.mods.modes import DEFAULT_FORWARD_MODE, FORWARD_MODES
from loka_trainer.mods.module import FusedLinearMods

ModuleFilter = Callable[[nn.Module, str], bool]

# what ``apply_mods`` replaces: norms over the Linear's output features, and pointwise activations
NORMS_TO_BLOCKNORM = (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d, BlockNorm)
ACTIVATIONS_TO_HARDSWISH = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.GELU, nn.Mish, nn.ELU, nn.Hardswish)


def _norm_width(norm: nn.Module) -> Optional[int]:
    """The feature count a norm normalizes over (its last dim), or None when it is not one of NORMS_TO_BLOCKNORM
    over one dim."""
    if isinstance(norm, (nn.BatchNorm1d, BlockNorm)):
        return norm.num_features
    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
        shape = tuple(norm.normalized_shape)
        return shape[0] if len(shape) == 1 else None
    return None


def apply_mods(model: nn.Module, *, block_size: int = 256, module_filter_fn: Optional[ModuleFilter] = None
               ) -> list[str]:
    """Put LoKA's Mods into ``model`` in place: in every ``nn.Sequential``, each ``nn.Linear`` -> norm ->
    activation (norm one of ``NORMS_TO_BLOCKNORM`` over the Linear's N outputs, activation one of
    ``ACTIVATIONS_TO_HARDSWISH``) becomes ``nn.Linear`` without bias -> ``BlockNorm(N, block_size)`` without
    affine -> ``HardSwish``, the triple ``convert_to_loka`` fuses into one ``FusedLinearMods``. Returns the
    changed Linears' FQNs (those ``module_filter_fn(linear, fqn)`` accepts, when given). The new norm and
    activation take over the hooks registered on the ones they replace (a triple with such a hook stays three
    modules: ``find_unfusable`` names it).

    This changes the model's function and drops parameters (the Linear's bias, the norm's affine and running
    statistics): apply it before training (and before building the optimizer), not to a trained model. The
    Linear keeps its weight Parameter object.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"apply_mods: block_size must be an integer >= 1, got {block_size!r}")
    changed = []
    for seq_fqn, seq in canonical_named_modules(model):
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq)
        for i in range(len(children) - 2):
            lin, norm, act = children[i:i + 3]
            fqn = f"{seq_fqn}.{i}" if seq_fqn else str(i)
            if not (isinstance(lin, nn.Linear) and _norm_width(norm) == lin.out_features
                    and isinstance(act, ACTIVATIONS_TO_HARDSWISH)):
                continue
            if module_filter_fn is not None and not module_filter_fn(lin, fqn):
                continue
            lin.register_parameter("bias", None)
            for index, new in ((i + 1, BlockNorm(lin.out_features, block_size=block_size)), (i + 2, HardSwish())):
                carry_hooks(seq[index], new)
                seq[index] = new
            changed.append(fqn)
    return changed


def _is_mods_triple(lin: nn.Module, norm: nn.Module, act: nn.Module) -> bool:
    """Linear (no bias) -> BlockNorm (no affine, over the Linear's output) -> HardSwish."""
    return (isinstance(lin, nn.Linear) and lin.bias is None and isinstance(norm, BlockNorm)
            and norm.weight is None and norm.num_features == lin.out_features
            and isinstance(act, nn.Hardswish))


def _unfusable_reason(lin: nn.Linear, norm: BlockNorm, act: nn.Module) -> Optional[str]:
    """Why a Mods triple stays three modules, or None: a shape the kernels cannot run, a parametrized Linear
    (``torch.nn.utils.parametrize``), whose weight is computed at each call (the fused layer, which takes
    ``lin.weight`` once, would keep that tensor as a constant, trained no more and gone from the state_dict), or
    a hook of the user's that only the three modules can run: any on the norm or the activation, any but a forward
    pre-hook on the Linear (that one moves to the fused layer, which takes the same input)."""
    if parametrize.is_parametrized(lin):
        return "its weight is parametrized"
    hooked = [type(m).__name__ for m, kinds in ((lin, OUTPUT_HOOKS + STATE_DICT_HOOKS), (norm, ALL_HOOKS),
                                                (act, ALL_HOOKS)) if held_hooks(m, kinds)]
    if hooked:  # the fused layer has no module whose output or state such a hook could see
        return f"a hook on its {' and '.join(hooked)}"
    return shapes.unsupported_reason(lin.in_features, lin.out_features, norm.block_size)


def _mods_triples(model: nn.Module, module_filter_fn: Optional[ModuleFilter]
                  ) -> dict[str, tuple[nn.Sequential, int, Optional[str]]]:
    """Linear FQN -> (parent Sequential, index, why the kernels cannot run it or None) for each Linear ->
    BlockNorm -> HardSwish triple that ``module_filter_fn`` (if given) accepts."""
    out = {}
    for seq_fqn, seq in canonical_named_modules(model):
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq)
        for i in range(len(children) - 2):
            fqn = f"{seq_fqn}.{i}" if seq_fqn else str(i)
            lin, norm = children[i], children[i + 1]
            if _is_mods_triple(*children[i:i + 3]) and (module_filter_fn is None or module_filter_fn(lin, fqn)):
                out[fqn] = (seq, i, _unfusable_reason(lin, norm, children[i + 2]))
    return out


def find_fusable(model: nn.Module, *, module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, tuple]:
    """Linear FQN -> (parent Sequential, index) for each fusable Linear -> BlockNorm -> HardSwish triple."""
    return {fqn: (seq, i) for fqn, (seq, i, why) in _mods_triples(model, module_filter_fn).items() if why is None}


def find_unfusable(model: nn.Module, *, module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, str]:
    """Linear FQN -> why the fused kernels cannot run it, for each Mods triple that stays three modules."""
    return {fqn: why for fqn, (_, _, why) in _mods_triples(model, module_filter_fn).items() if why is not None}


def fuse_linear_mods(model: nn.Module, *, kernels: Optional[dict[str, dict[str, str]]] = None,
                     module_filter_fn: Optional[ModuleFilter] = None, default_mode: str = DEFAULT_FORWARD_MODE
                     ) -> list[str]:
    """Replace each fusable triple in place; ``kernels`` maps Linear FQN -> {mode, dgrad, wgrad} (a layer it does
    not name: all BF16 in ``default_mode``). Returns the fused Linear FQNs. State_dict keys are unchanged."""
    fused = []
    for fqn, (seq, i) in find_fusable(model, module_filter_fn=module_filter_fn).items():
        seq[i] = FusedLinearMods.from_linear(seq[i], seq[i + 1], **(kernels or {}).get(fqn, {"mode": default_mode}))
        seq[i + 1], seq[i + 2] = nn.Identity(), nn.Identity()
        fused.append(fqn)
    return fused


def chain_fp8_handoffs(model: nn.Module) -> list[tuple[str, str]]:
    """Link each FusedLinearMods to the next one in its ``nn.Sequential`` (only ``nn.Identity`` between) when
    the next one's forward is FP8 and the first one's is split: the first emits its output in FP8, the second
    reads it (module docstring). Returns the linked (source FQN, reader FQN) pairs."""
    pairs = []
    for seq_fqn, seq in canonical_named_modules(model):
        if not isinstance(seq, nn.Sequential):
            continue
        prev: Optional[tuple[str, FusedLinearMods]] = None
        for name, child in seq.named_children():
            fqn = f"{seq_fqn}.{name}" if seq_fqn else name
            if isinstance(child, nn.Identity):
                continue
            if (isinstance(child, FusedLinearMods) and prev is not None and FORWARD_MODES[child.mode].fp8
                    and FORWARD_MODES[prev[1].mode].split and prev[1].out_features == child.in_features):
                prev[1].emit_fp8 = True
                object.__setattr__(child, "_fp8_source", prev[1])
                pairs.append((prev[0], fqn))
            prev = (fqn, child) if isinstance(child, FusedLinearMods) else None
    return pairs
