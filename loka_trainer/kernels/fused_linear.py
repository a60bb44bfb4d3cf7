"""FusedLinearMods and the model transform that puts it in place of Linear -> BlockNorm -> HardSwish.

Notation: M = prod(leading dims of x), K in_features, N out_features, B the BlockNorm block.

``layers.mlp`` builds ``nn.Sequential(Linear, norm, activation, ...)`` with stable child indices. With the
Mods on (no bias, ``BlockNorm`` without affine, ``HardSwish``) each triple is one fusable layer:
``fuse_linear_mods`` puts a ``FusedLinearMods`` at the Linear's index (same ``weight`` Parameter object, so
optimizer / FSDP state stay valid and the state_dict keys are unchanged: ``mlp.0.weight``) and
``nn.Identity`` at the norm and activation indices (they hold no parameters or buffers).

On a device without Triton (CPU) the module runs the exact unfused math in x's dtype, so CPU training is
unchanged; on CUDA it runs ``mods_ops.LinearModsFn`` (fused forward, fused dz backward) — except under
``torch.compile`` when all three GEMMs are BF16 (``plain_math_route``): inductor fuses BlockNorm + HardSwish
itself about as well as our kernels (H200, Wukong dense arch: Mods-only compiled 2202.9 µs vs fused 2173.3 µs,
docs/kernels/README.md) and launches them from its own wrapper, while each custom-op call of ours costs host time
that host-bound steps pay in full (InterFormer, docs/results.md section 2b).

FP8 handoff (``chain_fp8_handoffs``): when a FusedLinearMods feeds the next one directly (only ``nn.Identity``
between them in one ``nn.Sequential``) and that one's forward is FP8, the first one's epilogue also writes its
output in e4m3 at the static scale fp8_max / sqrt(B) (BlockNorm bounds it, see ``mods_ref``) and the second uses
it instead of quantizing its input: one pass over the activation and one kernel launch less per pair. The
handoff is eager-only (under ``torch.compile`` each layer quantizes its own input, which inductor schedules),
and only from a layer whose forward mode is split (cuBLAS + the epilogue kernel): in the H200 MLP-stack
profile the extra FP8 store made the single fused GEMM+epilogue kernel 29 µs slower at batch 4096 (3 layers)
against 17 µs of quantization saved, while the split epilogue kernel paid 8 µs for it (docs/kernels/README.md).
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from loka_trainer.kernels import triton_mods
from loka_trainer.kernels.backends import BASELINE
from loka_trainer.kernels.linear import WeightCache
from loka_trainer.kernels.mods_modes import DEFAULT_FORWARD_MODE, FORWARD_MODES
from loka_trainer.kernels.mods_ops import linear_mods_fp8_out, static_scale_inv
from loka_trainer.kernels.plan import ModsChoice
from loka_trainer.kernels.triton_quant import interpreting
from loka_trainer.models.layers import BlockNorm, block_rms_norm

ModuleFilter = Callable[[nn.Module, str], bool]


def plain_math_route(*, on_cuda: bool, compiling: bool, interpreting: bool, mode: str, dgrad: str,
                     wgrad: str) -> bool:
    """True when a FusedLinearMods call should run the unfused PyTorch math instead of the Triton path: no
    Triton device (CPU outside the interpreter), or compiled with a BF16 forward and BF16 dgrad and wgrad."""
    if not (on_cuda or (not compiling and interpreting)):
        return True
    return compiling and not FORWARD_MODES[mode].fp8 and dgrad == BASELINE and wgrad == BASELINE


class FusedLinearMods(nn.Module):
    """HardSwish(BlockNorm(x·Wᵀ)) as one module: x (..., K) -> (..., N). Parameter ``weight`` (N, K), no bias.

    ``mode`` is the forward kernel (``mods_modes.FORWARD_MODES``); ``dgrad`` / ``wgrad`` the backends of
    dx = dz·W and dW = dzᵀ·x (``bf16`` = cuBLAS; a ``torch._scaled_mm`` dgrad runs fused,
    ``mods_ops_fp8.FUSED_DGRAD``).
    """

    def __init__(self, in_features: int, out_features: int, *, block_size: int = 256, eps: float = 1e-6,
                 mode: str = DEFAULT_FORWARD_MODE, dgrad: str = "bf16", wgrad: str = "bf16", device=None,
                 dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Linear's init
        self.block_size, self.eps = block_size, eps
        self.set_kernels(mode=mode, dgrad=dgrad, wgrad=wgrad)
        self._weight_cache = WeightCache()
        self._init_handoff()

    def set_kernels(self, *, mode: str, dgrad: str, wgrad: str) -> None:
        """Choose the forward mode and the two backward backends; unknown names -> ValueError."""
        if mode not in FORWARD_MODES:
            raise ValueError(f"FusedLinearMods mode: unknown {mode!r}; valid: {sorted(FORWARD_MODES)}")
        from loka_trainer.kernels.backends import get_backend
        get_backend(dgrad), get_backend(wgrad)
        self.mode, self.dgrad, self.wgrad = mode, dgrad, wgrad

    @classmethod
    def from_linear(cls, linear: nn.Module, norm: BlockNorm, **kernels: str) -> "FusedLinearMods":
        """Replacement sharing ``linear.weight`` (the Parameter object itself)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.block_size, new.eps = norm.block_size, norm.eps
        new.set_kernels(**{"mode": DEFAULT_FORWARD_MODE, "dgrad": "bf16", "wgrad": "bf16", **kernels})
        new._weight_cache = WeightCache()
        new._init_handoff()
        return new

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._weight_cache.clear()  # new weight values, possibly written without a version bump
        super()._load_from_state_dict(*args, **kwargs)

    def _init_handoff(self) -> None:
        self.emit_fp8 = False  # write the output in FP8 too, for the next FusedLinearMods
        # the FusedLinearMods whose FP8 output this one reads (plain attribute: not a submodule, not in state_dict)
        object.__setattr__(self, "_fp8_source", None)
        self._handoff: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (output as returned, its e4m3 copy)

    def _take_fp8_input(self, x: torch.Tensor) -> Optional[tuple[torch.Tensor, float]]:
        """(x in e4m3 (M, K), scale_inv) if the source layer's last output is exactly ``x``, else None."""
        src = self._fp8_source
        if src is None or src._handoff is None or src._handoff[0] is not x:
            return None
        q = src._handoff[1]
        src._handoff = None  # hand over once; free it with the activation's other consumers
        return q, static_scale_inv(src.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N)."""
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        compiling = torch.compiler.is_compiling()
        # NOTE: interpreting() only outside compiled code: torch.compile never traces its environment lookup.
        if plain_math_route(on_cuda=x2.is_cuda, compiling=compiling, interpreting=not compiling and interpreting(),
                            mode=self.mode, dgrad=self.dgrad, wgrad=self.wgrad):
            # exact unfused math in x's dtype (CPU training stays as it was; inductor fuses it when compiled)
            y = F.hardswish(block_rms_norm(F.linear(x2, self.weight.to(x2.dtype)), self.block_size, self.eps))
        else:
            eager = not compiling
            x_fp8 = self._take_fp8_input(x) if eager else None
            y, q = linear_mods_fp8_out(x2, self.weight, block=self.block_size, eps=self.eps, mode=self.mode,
                                       dgrad=self.dgrad, wgrad=self.wgrad, cache=self._weight_cache,
                                       x_fp8=None if x_fp8 is None else x_fp8[0],
                                       x_fp8_scale_inv=1.0 if x_fp8 is None else x_fp8[1],
                                       emit_fp8=self.emit_fp8 and eager)
            out = y.reshape(*x.shape[:-1], self.out_features)
            if eager:
                self._handoff = None if q is None else (out, q)
            return out
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, block_size={self.block_size}, mode={self.mode}, "
                f"dgrad={self.dgrad}, wgrad={self.wgrad}" + (", emit_fp8=True" if self.emit_fp8 else ""))


def _is_fusable(lin: nn.Module, norm: nn.Module, act: nn.Module) -> bool:
    """Linear (no bias) -> BlockNorm (no affine, over the Linear's output) -> HardSwish, kernel-supported."""
    return (isinstance(lin, nn.Linear) and lin.bias is None and isinstance(norm, BlockNorm)
            and norm.weight is None and norm.num_features == lin.out_features
            and isinstance(act, nn.Hardswish)
            and triton_mods.supports(lin.in_features, lin.out_features, norm.block_size))


def find_fusable(model: nn.Module, *, module_filter_fn: Optional[ModuleFilter] = None) -> dict[str, tuple]:
    """Linear FQN -> (parent Sequential, index) for each fusable Linear -> BlockNorm -> HardSwish triple."""
    out = {}
    for seq_fqn, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq)
        for i in range(len(children) - 2):
            fqn = f"{seq_fqn}.{i}" if seq_fqn else str(i)
            if _is_fusable(*children[i:i + 3]) and (module_filter_fn is None or module_filter_fn(children[i], fqn)):
                out[fqn] = (seq, i)
    return out


def fuse_linear_mods(model: nn.Module, *, kernels: Optional[dict[str, dict[str, str]]] = None,
                     module_filter_fn: Optional[ModuleFilter] = None) -> list[str]:
    """Replace each fusable triple in place; ``kernels`` maps Linear FQN -> {mode, dgrad, wgrad} (default
    all BF16, fused forward). Returns the fused Linear FQNs. State_dict keys are unchanged."""
    fused = []
    for fqn, (seq, i) in find_fusable(model, module_filter_fn=module_filter_fn).items():
        seq[i] = FusedLinearMods.from_linear(seq[i], seq[i + 1], **(kernels or {}).get(fqn, {}))
        seq[i + 1], seq[i + 2] = nn.Identity(), nn.Identity()
        fused.append(fqn)
    return fused


def chain_fp8_handoffs(model: nn.Module) -> list[tuple[str, str]]:
    """Link each FusedLinearMods to the next one in its ``nn.Sequential`` (only ``nn.Identity`` between) when
    the next one's forward is FP8 and the first one's is split: the first emits its output in FP8, the second
    reads it (module docstring). Returns the linked (source FQN, reader FQN) pairs."""
    pairs = []
    for seq_fqn, seq in model.named_modules():
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


def _random_layer(M: int, K: int, N: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K), w (N, K) random bf16 leaves on ``device`` that require grad."""
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    return x, (torch.randn(N, K, device=device) / K ** 0.5).to(torch.bfloat16).requires_grad_()


def _time_each(names: list[str], run, timer, what: str, shape: tuple[int, int, int]) -> dict[str, Optional[float]]:
    """name -> timer(lambda: run(name)) µs; a name whose run raises RuntimeError -> None (with a warning): a kernel
    that fails at this shape is not a candidate, never an error."""
    times: dict[str, Optional[float]] = {}
    for name in names:
        try:
            times[name] = timer(lambda name=name: run(name))
        except RuntimeError as exc:
            warnings.warn(f"{what} {name} failed at M×K×N={'×'.join(map(str, shape))}: "
                          f"{str(exc).splitlines()[0][:200]}")
            times[name] = None
    return times


def time_forward_modes(M: int, K: int, N: int, modes: list[str], *, block: int, eps: float, timer,
                       device) -> dict[str, Optional[float]]:
    """µs of one training forward (autograd on, weight cast cached as in training) of each forward mode at
    x (M, K), w (N, K) random bf16 on ``device``; a mode that raises there -> None (with a warning)."""
    x, w = _random_layer(M, K, N, device)
    cache = WeightCache()
    run = lambda mode: linear_mods_fp8_out(x, w, block=block, eps=eps, mode=mode, cache=cache)  # noqa: E731
    return _time_each(modes, run, timer, "mods forward mode", (M, K, N))


def time_input_grads(M: int, K: int, N: int, dgrads: list[str], *, mode: str, wgrad: str, block: int, eps: float,
                     timer, device) -> dict[str, Optional[float]]:
    """µs of one training step of the layer (forward in ``mode`` + backward with ``wgrad``; gradients written
    fresh, as after ``zero_grad(set_to_none=True)``) with each input-grad backend in ``dgrads``, at random bf16
    x (M, K), w (N, K) and dy (M, N) on ``device``; one that raises there -> None (with a warning)."""
    x, w = _random_layer(M, K, N, device)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    cache = WeightCache()

    def step(dgrad: str) -> None:
        x.grad = w.grad = None
        linear_mods_fp8_out(x, w, block=block, eps=eps, mode=mode, dgrad=dgrad, wgrad=wgrad,
                            cache=cache)[0].backward(dy)
    return _time_each(dgrads, step, timer, "mods input grad", (M, K, N))


def kernels_from_plan_backends(backends: dict[str, str], mods: Optional[ModsChoice] = None,
                               mods_input_grad: Optional[ModsChoice] = None) -> dict[str, str]:
    """A Dispatch plan's per-GEMM choice {forward, input_grad, weight_grad} -> FusedLinearMods kernels.

    The forward mode is the plan's measured one (``mods``: timed per layer when the plan was built on a GPU,
    ``convert.build_plan``); without it, a forward that Dispatch found worth FP8 runs the fused kernel on
    rowwise-FP8 inputs, a BF16 forward ``mods_modes.DEFAULT_FORWARD_MODE`` (cuBLAS GEMM + one Triton
    BlockNorm/HardSwish epilogue kernel; see there why). The two backward GEMMs keep the plan's backends; a
    ``scaled_mm_rowwise`` or ``scaled_mm_tensorwise`` dgrad then runs fused (dz amax from the dz kernel, one cast
    pass, ``mods_ops_fp8.FUSED_DGRAD``) with the backend's numerics. ``mods_input_grad`` (timed over the whole layer
    when the plan was built on a GPU) replaces the plan's input-grad backend.
    """
    if mods is not None:
        mode = mods.mode
    else:
        mode = DEFAULT_FORWARD_MODE if backends.get("forward", "bf16") == "bf16" else "fused_fp8"
    dgrad = mods_input_grad.mode if mods_input_grad is not None else backends.get("input_grad", "bf16")
    return {"mode": mode, "dgrad": dgrad, "wgrad": backends.get("weight_grad", "bf16")}
