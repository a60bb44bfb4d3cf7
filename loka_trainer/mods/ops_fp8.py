"""The fused Mods layer's FP8 backward pieces: dz quantized by the dz kernels for an FP8 dgrad (a ``triton_op``), the
fused dgrad (``FUSED_DGRAD``) and the folded weight grad (``FOLDED_WGRAD``) that ``mods.ops.LinearModsFn`` routes to.

Notation: M rows, K in-features, N out-features, B the BlockNorm block, NB = N / B.

Fused dgrad (``FUSED_DGRAD``): when the plan's dgrad backend is ``scaled_mm_rowwise`` or ``scaled_mm_tensorwise``
the layer does not call the backend (dz kernel, then a quantizer reading dz twice: amax, cast) but has the dz
kernel write the amaxes, so one cast pass reads dz once, and runs ``torch._scaled_mm`` against the backend's
cached (K, N) e4m3 weight. The numerics are the backend's exactly (rowwise e4m3, or tensorwise e5m2, of the
bf16 dz; the backend's e4m3 Wᵀ), so the Dispatch plan's name and its MERE stay valid; only the kernels differ.
Any other dgrad backend runs unfused.

The ``*_fast_accum`` twins of both backends run the same way on the fast-accumulation GEMM.

Folded weight grad (``FOLDED_WGRAD``): when the forward is FP8 and the plan's wgrad backend is
``scaled_mm_tensorwise`` (or its ``_fast_accum`` twin), dW comes from the forward's rowwise FP8 x with its row
scales folded into dz (``wgrad_fold``): no quantization of x in the backward. Its x operand is finer (rowwise)
than the backend's. With a fused FP8 dgrad, the dz kernel finds the folded amax and the dgrad's cast kernel
(rowwise) or one more pass (tensorwise) writes (dz·sx)ᵀ; otherwise ``wgrad_fold`` makes it from the bf16 dz.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.library import triton_op

from loka_trainer.kernels.backends import BACKENDS
from loka_trainer.kernels.backends_scaled_mm import ScaledMMBackend, scaled_mm_nt
from loka_trainer.kernels.linear import WeightCache
from loka_trainer.kernels.quant import quantize
from loka_trainer.kernels.triton_env import use_triton
from loka_trainer.mods import triton_mods
from loka_trainer.mods.reference import mods_backward_ref, u_from_z
from loka_trainer.mods.wgrad_fold import DZ_DTYPE, fold_dz_ref


@torch.no_grad()
def mods_backward_fp8_ref(dh: Tensor, u: Tensor, r: Tensor, block: int, granularity: str = "rowwise",
                          fold_sx: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Optional[tuple]]:
    """dh (M, N), u (M, N), r (M, NB) -> (dz_q (M, N) fp8, scale_inv fp32 ((M, 1) rowwise, () tensorwise),
    dz (M, N) bf16, folded): ``folded`` = (dzt (N, M) e5m2, scale_inv ()) of (dz·fold_sx)ᵀ when ``fold_sx``
    (M, 1) is given (``wgrad_fold``), else None. (A forward that kept z: ``mods.reference.u_from_z`` gives u.)"""
    dz = mods_backward_ref(dh, u, r, block)
    dz_q, scale_inv = quantize(dz, granularity, triton_mods.DZ_FP8[granularity][0])
    folded = fold_dz_ref(dz, fold_sx) if fold_sx is not None else None
    return dz_q, scale_inv, dz, folded


@triton_op("loka::mods_bwd_dz_fp8", mutates_args=())
def mods_bwd_dz_fp8(dh: Tensor, u: Tensor, r: Tensor, block: int, write_bf16: bool, granularity: str = "rowwise",
                    fold_sx: Optional[Tensor] = None, from_z: bool = False, z_row_scale: Optional[Tensor] = None,
                    z_col_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dh (M, N), u (M, N) bf16, r (M, NB) fp32 -> (dz_q (M, N) fp8, scale_inv fp32, dz (M, N) bf16, dzt (N, M)
    e5m2, dzt's scale_inv ()) as ``mods_backward_fp8_ref``; dz is an empty (0, N) tensor unless ``write_bf16``,
    dzt an empty (0, M) one and its scale an empty (0,) one unless ``fold_sx`` (ops cannot return None).
    ``from_z``, ``z_row_scale``, ``z_col_scale``: u holds z, as for ``mods.ops.mods_bwd_dz``."""
    if granularity not in triton_mods.DZ_FP8:
        raise ValueError(f"mods_bwd_dz_fp8: unknown granularity {granularity!r}; valid: {sorted(triton_mods.DZ_FP8)}")
    if use_triton(dh):
        dz_q, scale_inv, dz, folded = triton_mods.backward_dz_fp8(dh, u, r, block=block, write_bf16=write_bf16,
                                                                  granularity=granularity, fold_sx=fold_sx,
                                                                  from_z=from_z, z_row_scale=z_row_scale,
                                                                  z_col_scale=z_col_scale)
    else:
        u = u_from_z(u, r, block, z_row_scale, z_col_scale) if from_z else u
        dz_q, scale_inv, dz, folded = mods_backward_fp8_ref(dh, u, r, block, granularity, fold_sx)
    if folded is None:
        # NOTE: empty, not a filled scalar: a fill is one more kernel in every FP8 dgrad step
        folded = (dh.new_empty((0, dh.shape[0]), dtype=DZ_DTYPE), dh.new_empty((0,), dtype=torch.float32))
    return (dz_q, scale_inv, dz if write_bf16 else dh.new_empty((0, dh.shape[1]), dtype=torch.bfloat16),
            *folded)


def _dgrad_fp8(backend: ScaledMMBackend, dh: Tensor, u: Tensor, r: Tensor, block: int, w: Tensor,
               cache: WeightCache, need_dz: bool, fold_sx: Optional[Tensor] = None, z_src: tuple = (False, None, None)
               ) -> tuple[Callable[[], Tensor], Optional[Tensor], Optional[tuple[Tensor, Tensor]]]:
    """dh (M, N) -> (dx thunk () -> (M, K) bf16, dz (M, N) bf16 or None, folded or None): the dz+quantization
    kernels run now (dz quantized at ``backend``'s granularity), the GEMM (``torch._scaled_mm`` against Wᵀ (K, N)
    e4m3, cast once per weight version by ``backend``; with its accumulation) when the thunk is called, so the
    weight grad can run beside it. ``fold_sx`` (M, 1): the same kernels also write the folded weight grad's dz
    operand, ``folded`` = (dzt (N, M) e5m2, scale_inv ()). ``z_src`` (from_z, z_row_scale, z_col_scale): what u
    holds (``mods_bwd_dz_fp8``)."""
    dz_q, s_dz, dz, dzt, s_dzt = mods_bwd_dz_fp8(dh, u, r, block, need_dz, backend.granularity, fold_sx, *z_src)
    wt_q, s_wt = cache.get(w, backend.name, "input_grad")
    return ((lambda: scaled_mm_nt(dz_q, s_dz, wt_q, s_wt, backend.fast_accum)), (dz if need_dz else None),
            ((dzt, s_dzt) if fold_sx is not None else None))


_SCALED_MM = {name: b for name, b in BACKENDS.items() if isinstance(b, ScaledMMBackend)}

# dgrad backend name -> the fused implementation of the same numerics (see the module docstring)
FUSED_DGRAD: dict[str, Callable[..., tuple[Callable[[], Tensor], Optional[Tensor], Optional[tuple]]]] = {
    name: functools.partial(_dgrad_fp8, b) for name, b in _SCALED_MM.items()
}

# wgrad backends that a layer with an FP8 forward runs folded (``wgrad_fold``): from the forward's FP8 x (xq, sx)
# instead of x, x's row scales folded into dz. Its x operand is rowwise (the forward's) where the backend's is
# tensorwise: ``wgrad_fold``'s docstring gives the numerics. Name -> whether its GEMM accumulates fast.
FOLDED_WGRAD: dict[str, bool] = {name: b.fast_accum for name, b in _SCALED_MM.items() if b.granularity == "tensorwise"}
