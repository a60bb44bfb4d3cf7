"""LoKALinear: an ``nn.Linear`` whose three GEMMs each run on the backend the Dispatch plan chose.

Notation: M = prod(leading dims of x), K in_features, N out_features.

Same parameters and state_dict keys as ``nn.Linear`` (it *is* an ``nn.Linear``), so it loads an ``nn.Linear``
checkpoint and its checkpoint loads back into an ``nn.Linear``. Once ``register_weight_cache_hook`` ties the
layers to the optimizer, the weight operands of forward and input-grad are quantized once per weight version and
optimizer step (``WeightCache``) and reused by every GEMM and forward until the next step; before, each forward
quantizes them afresh.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from loka_trainer.kernels.backend_base import GEMMS, QuantOperand
from loka_trainer.kernels.backends import BASELINE, get_backend
from loka_trainer.kernels.triton_env import traced
from loka_trainer.module_hooks import carry_hooks


class WeightCache:
    """Quantized weight operands keyed by (backend, gemm), valid while the weight tensor, its storage and its
    version hold and until ``clear()``; served to later calls only while ``reuses`` (else each ``get`` quantizes
    afresh).

    NOTE: (data_ptr, version) alone is not a safe key under FSDP2: the all-gather rewrites the unsharded weight
    without bumping its version counter, and the allocator may give it the same address the next step, which
    served the previous step's FP8 weight (seen in a 2-rank test); an optimizer that writes ``p.data`` (a common
    idiom in hand-written ones) bumps no version either, so a cache no step clears would serve its first step's
    FP8 weights to every later one. So a LoKA layer's cache (``reuse=False``) reuses operands only while an
    optimizer step hook clears it (``register_weight_cache_hook``), and loading a state_dict clears it too. A copy
    (``copy.deepcopy``, pickling) starts empty and unhooked: the hook belongs to the original's optimizer.
    """

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse  # reuse operands across calls without a hook (a cache a caller clears itself)
        self.hooks = 0  # optimizer step hooks that clear this cache (``register_weight_cache_hook``)
        self._key: Optional[tuple[int, int]] = None
        # the weight the operands were cast from: another tensor at the freed one's address and version 0 (what
        # ``torch.func.functional_call`` with temporary parameters gives each call) is another weight
        self._source: Optional[weakref.ref] = None
        self._ops: dict[tuple[str, str], QuantOperand] = {}
        self.num_casts = 0  # how many times an operand was quantized (tests assert once per step)

    @property
    def reuses(self) -> bool:
        """Whether an operand serves later calls (until the weight changes or ``clear()``)."""
        return self.reuse or self.hooks > 0

    def __getstate__(self) -> dict:
        return {**self.__dict__, "hooks": 0, "_key": None, "_ops": {}, "_source": None}

    def get(self, w: torch.Tensor, backend_name: str, gemm: str) -> QuantOperand:
        """w (N, K) -> the cached operand for ``gemm`` ('forward' | 'input_grad') of ``backend_name``."""
        if traced(w):  # a Python-side cache would break the graph (a fake w has no address); compile fuses the cast
            return self._quantize(w, backend_name, gemm)
        if not self.reuses:
            self.num_casts += 1
            return self._quantize(w, backend_name, gemm)
        key = (w.data_ptr(), w._version)
        if key != self._key or self._source is None or self._source() is not w:
            self._key, self._ops, self._source = key, {}, weakref.ref(w)
        if (backend_name, gemm) not in self._ops:
            self._ops[(backend_name, gemm)] = self._quantize(w, backend_name, gemm)
            self.num_casts += 1
        return self._ops[(backend_name, gemm)]

    @property
    def nbytes(self) -> int:
        """Bytes the cached operands hold (FP8 data and scales): device memory kept until the next ``clear()``."""
        return sum(t.numel() * t.element_size() for op in self._ops.values() for t in op if t is not None)

    def clear(self) -> None:
        """Forget every operand (the optimizer stepped, or the weight was loaded from a state_dict)."""
        self._key, self._ops, self._source = None, {}, None

    @staticmethod
    def _quantize(w: torch.Tensor, backend_name: str, gemm: str) -> QuantOperand:
        backend = get_backend(backend_name)
        with torch.no_grad():
            if gemm == "forward":
                return backend.quantize_weight_forward(w)
            return backend.quantize_weight_input_grad(w)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """nn.Linear's output dtype: the autocast dtype when autocast is on for x's device, else x's dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _LoKALinearFn(torch.autograd.Function):
    """y = x·Wᵀ (+ b) with forward / input_grad / weight_grad each on its own backend.

    x (M, K), w (N, K), b (N,) or None -> y (M, N). Backend names are plain strings (constants for
    torch.compile); ``cache`` is the module's WeightCache.
    """

    @staticmethod
    def forward(ctx, x, w, b, fwd: str, dgrad: str, wgrad: str, cache: WeightCache):
        M, K = x.shape
        N = w.shape[0]
        # A shape the chosen backend cannot run (e.g. a ragged last batch) falls back to BF16 for that call.
        names = [n if get_backend(n).supports(M, K, N) else BASELINE for n in (fwd, dgrad, wgrad)]
        fwd, dgrad, wgrad = names
        y = get_backend(fwd).forward(x, w, w_q=cache.get(w, fwd, "forward"))
        out_dtype = _out_dtype(x)
        y = y.to(out_dtype)
        if b is not None:
            y = y + b.to(out_dtype)
        ctx.save_for_backward(x, w)
        ctx.names = (dgrad, wgrad)
        ctx.wt_q = cache.get(w, dgrad, "input_grad") if ctx.needs_input_grad[0] else None
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dgrad, wgrad = ctx.names
        # NOTE: in order on one stream. On two streams (as ``mods.ops.LinearModsFn`` runs them) this layer was
        # slower per step at 15 of 18 figure-13 cases on the H200, by 1.4-4.3 us (docs/kernels/README.md "Backward").
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = get_backend(dgrad).input_grad(dy, w, wt_q=ctx.wt_q).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = get_backend(wgrad).weight_grad(dy, x).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32)  # fp32 accumulation without an fp32 copy of dy
        ctx.wt_q = None  # free the FP8 operand with the graph
        return dx, dw, db, None, None, None, None


def linear_on_backends(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], *, forward: str, input_grad: str,
                       weight_grad: str, cache: WeightCache) -> torch.Tensor:
    """y = x·Wᵀ (+ b) with each GEMM on its backend: x (M, K), w (N, K), b (N,) or None -> y (M, N) in
    nn.Linear's output dtype. ``cache`` holds the quantized weight operands (``WeightCache``)."""
    return _LoKALinearFn.apply(x, w, b, forward, input_grad, weight_grad, cache)


class LoKALinear(nn.Linear):
    """Drop-in ``nn.Linear``; ``backends`` maps 'forward' / 'input_grad' / 'weight_grad' -> backend name."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 backends: Optional[dict[str, str]] = None, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.set_backends(backends or {})
        self._weight_cache = WeightCache(reuse=False)

    def set_backends(self, backends: dict[str, str]) -> None:
        """Route each GEMM; missing GEMMs stay BF16; unknown GEMM or backend -> ValueError."""
        unknown = set(backends) - set(GEMMS)
        if unknown:
            raise ValueError(f"LoKALinear backends: unknown GEMM(s) {sorted(unknown)}; valid: {list(GEMMS)}")
        for name in backends.values():
            get_backend(name)
        self.backends = {g: backends.get(g, BASELINE) for g in GEMMS}

    @classmethod
    def from_linear(cls, linear: nn.Linear, backends: dict[str, str]) -> "LoKALinear":
        """Swap-in replacement sharing ``linear``'s Parameter objects (optimizer and FSDP state stay valid) and
        its hooks (``module_hooks.carry_hooks``: it computes the same function)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.set_backends(backends)
        new._weight_cache = WeightCache(reuse=False)
        carry_hooks(linear, new)
        return new

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._weight_cache.clear()  # new weight values, possibly written without a version bump
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N)."""
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        b = self.backends
        y = linear_on_backends(x2, self.weight, self.bias, forward=b["forward"], input_grad=b["input_grad"],
                               weight_grad=b["weight_grad"], cache=self._weight_cache)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        b = self.backends
        return f"{super().extra_repr()}, fwd={b['forward']}, dgrad={b['input_grad']}, wgrad={b['weight_grad']}"


def weight_caches(model: nn.Module) -> list[WeightCache]:
    """The WeightCache of every LoKA layer of ``model`` (``LoKALinear``, ``FusedLinearMods``)."""
    return [c for m in model.modules() if isinstance(c := getattr(m, "_weight_cache", None), WeightCache)]


class WeightCacheHook:
    """What ``register_weight_cache_hook`` returns: ``remove()`` detaches the optimizer hook, and the caches it
    cleared quantize afresh at each call again (unless another hook still clears them)."""

    def __init__(self, handle: RemovableHandle, caches: list[WeightCache]) -> None:
        self._handle, self._caches = handle, caches

    def remove(self) -> None:
        if self._handle is None:
            return
        self._handle.remove()
        self._handle = None
        for cache in self._caches:
            cache.hooks -= 1
            cache.clear()


def register_weight_cache_hook(model: nn.Module, optimizer: torch.optim.Optimizer) -> WeightCacheHook:
    """Clear the cached FP8 weight operands of ``model``'s LoKA layers after every ``optimizer.step()``, so the next
    forward quantizes the new weights (``WeightCache``'s note says why a step must clear them), and from now on let
    the layers reuse those operands between steps (without the hook each forward quantizes afresh). Call it after
    ``convert_to_loka`` (it finds the layers then) with the optimizer that updates those weights; the returned
    handle's ``remove()`` detaches it. A model with no LoKA layer yet gets a warning: nothing would be reused."""
    caches = weight_caches(model)
    if not caches:
        warnings.warn("register_weight_cache_hook: the model has no LoKA layer (call it after convert_to_loka); "
                      "the hook clears nothing", stacklevel=2)

    def clear_caches(opt, args, kwargs) -> None:
        for cache in caches:
            cache.clear()
    handle = optimizer.register_step_post_hook(clear_caches)
    for cache in caches:
        cache.hooks += 1
    return WeightCacheHook(handle, caches)
