from __future__ import annotations

import pytest
import torch

from loka_trainer.dispatch.measure import fp32_reference
from loka_trainer.kernels.backend_base import GemmBackend
from loka_trainer.kernels.backends import BACKENDS, available_backends, get_backend
from loka_trainer.probe.mere import mere

CPU_BACKENDS = sorted(available_backends("cpu"))
# Stated bounds on the normwise relative error ||out - ref|| / ||ref|| vs fp32 for N(0,1) operands:
# bf16 (8 mantissa bits) 1%, e4m3 operands 6%, GEMMs with an e5m2 gradient operand 10%. (Element-wise MERE
# is much larger on such data because many outputs are near zero; it is what Dispatch thresholds.)
BOUND = {"bf16": 0.01}
E4M3_BOUND, E5M2_BOUND = 0.06, 0.10


def _bound(name: str, gemm: str) -> float:
    if name == "bf16" or (name.endswith("gw_hp") and gemm == "weight_grad"):
        return BOUND["bf16"]
    uses_e5m2 = name.removesuffix("_fast_accum").endswith("tensorwise") and gemm != "forward"
    return E5M2_BOUND if uses_e5m2 else E4M3_BOUND


def _normwise(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _operands(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(M, N, generator=g))


def test_cpu_candidates_include_bf16_scaled_mm_and_torchao_but_not_gpu_only():
    assert {"bf16", "scaled_mm_tensorwise", "scaled_mm_rowwise"} <= set(CPU_BACKENDS)
    assert not any(n.startswith(("fbgemm", "triton")) for n in CPU_BACKENDS)
    for name, b in BACKENDS.items():
        assert b.name == name and isinstance(b, GemmBackend)


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_cpu_fp8_gemm_is_torchs_scaled_mm_up_to_bf16_rounding(granularity):
    """``scaled_mm_nt`` on CPU (an fp32 matmul of the fp8 values, then the scales) against ``torch._scaled_mm``
    itself, at a shape small enough for oneDNN's reference FP8 loop: the same numbers up to one bf16 rounding."""
    from loka_trainer.kernels.backends_scaled_mm import scaled_mm_nt
    from loka_trainer.kernels.quant import quantize
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(32, 64, generator=g) * 3, torch.randn(48, 64, generator=g)
    (qa, sa), (qb, sb) = (quantize(t, granularity, torch.float8_e4m3fn) for t in (a, b))
    ours = scaled_mm_nt(qa.contiguous(), sa, qb.contiguous(), sb)
    torchs = torch._scaled_mm(qa.contiguous(), qb.contiguous().t(), scale_a=sa,
                              scale_b=sb if sb.dim() == 0 else sb.reshape(1, -1), out_dtype=torch.bfloat16)
    assert ours.dtype == torchs.dtype == torch.bfloat16 and ours.shape == (32, 48)
    torch.testing.assert_close(ours.float(), torchs.float(), rtol=2 ** -7, atol=1e-6)
    assert _normwise(ours.float(), a @ b.t()) < 0.1  # and it is the product, not just equal garbage


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_backends_emulate_on_cpu_with_the_recipes_accumulation(recipe):
    """On CPU torchao's FP8 GEMMs run its fp32 emulation (``TorchaoBackend._mm_config``), per GEMM keeping the
    recipe's fast-accumulation setting, so the config reaching torchao on CUDA differs only in ``emulate``."""
    from torchao.float8.config import Float8LinearConfig
    b = get_backend(f"torchao_{recipe}")
    mm_config = b._cast(torch.randn(32, 64), b._config().cast_config_input, "INPUT", -1)._linear_mm_config
    recipe_config = Float8LinearConfig.from_recipe_name(recipe)
    gemm_configs = (recipe_config.gemm_config_output, recipe_config.gemm_config_grad_input,
                    recipe_config.gemm_config_grad_weight)
    assert all(c.emulate for c in mm_config)
    assert [c.use_fast_accum for c in mm_config] == [g.use_fast_accum for g in gemm_configs]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("gemm", ["forward", "input_grad", "weight_grad"])
def test_three_gemms_shape_dtype_and_error(name, gemm):
    M, K, N = 96, 160, 64
    x, w, dy = _operands(M, K, N)
    b = get_backend(name)
    assert b.supports(M, K, N)
    out = {"forward": lambda: b.forward(x, w), "input_grad": lambda: b.input_grad(dy, w),
           "weight_grad": lambda: b.weight_grad(dy, x)}[gemm]()
    ref = fp32_reference(gemm, x, w, dy)
    assert out.shape == ref.shape and out.dtype in (torch.bfloat16, torch.float32)
    err = _normwise(out, ref)
    assert err < _bound(name, gemm)
    if _bound(name, gemm) > BOUND["bf16"]:  # an FP8 path really quantizes: visibly worse than bf16
        assert err > 2 * _normwise(get_backend("bf16").forward(x, w), fp32_reference("forward", x, w, dy))
        assert mere(out, ref) > 0.0


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_precomputed_weight_operand_gives_same_result(name):
    x, w, dy = _operands(32, 64, 48, seed=3)
    b = get_backend(name)
    assert torch.equal(b.forward(x, w), b.forward(x, w, w_q=b.quantize_weight_forward(w)))
    assert torch.equal(b.input_grad(dy, w), b.input_grad(dy, w, wt_q=b.quantize_weight_input_grad(w)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="on CPU scaled_mm_nt is an fp32 matmul: no flag to pass")
def test_fast_accum_twins_reach_scaled_mm_in_all_three_gemms(monkeypatch):
    from loka_trainer.kernels.backends_scaled_mm import scaled_mm_backends
    flags, scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: flags.append(k["use_fast_accum"]) or scaled_mm(*a, **k))
    x, w, dy = _operands(32, 64, 48, seed=4)
    backends = scaled_mm_backends()
    assert {n for n, b in backends.items() if b.fast_accum} == {f"{n}_fast_accum" for n, b in backends.items()
                                                                 if not b.fast_accum}
    for name, b in backends.items():
        flags.clear()
        b.forward(x, w), b.input_grad(dy, w), b.weight_grad(dy, x)
        assert flags == [b.fast_accum] * 3, name
        assert get_backend(name).fast_accum == b.fast_accum  # the registry holds the same twins


def test_supports_rejects_unaligned_shapes_for_fp8():
    assert not get_backend("scaled_mm_rowwise").supports(100, 64, 64)
    assert get_backend("bf16").supports(100, 63, 7)


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="scaled_mm_rowwise"):
        get_backend("cublas_fp4")


def _spiky(rows: int, cols: int, seed: int) -> torch.Tensor:
    """N(0, 1) with one channel at 100x and one value at 3e5: every scale granularity flushes something else."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, 1] *= 100.0
    x[3, 5] = 3e5
    return x.to(torch.bfloat16)


def _own_casts(backend, gemm: str, x, w, dy, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run one GEMM of ``backend`` and return, in the order cast (a then b), (operand, its FP8 cast) for every
    operand the backend's own code cast to FP8 (torchao: each ``_cast``; the others: ``mm_nt``'s a, b)."""
    casts = []
    if hasattr(backend, "_cast"):
        cast = backend._cast

        def recording(t, *args):
            out = cast(t, *args)
            if hasattr(out, "_data"):  # a Float8TrainingTensor; a disabled cast returns the bf16 operand itself
                casts.append((t, out._data))
            return out
        monkeypatch.setattr(backend, "_cast", recording)
    else:
        mm_nt, mm_nt_q = backend.mm_nt, backend._mm_nt_q
        operands = []

        def recording_mm_nt(a, b, **kwargs):
            operands[:] = [a, b]
            return mm_nt(a, b, **kwargs)

        def recording_mm_nt_q(qa, qb):
            casts.extend(zip(operands, (qa[0], qb[0])))
            return mm_nt_q(qa, qb)
        monkeypatch.setattr(backend, "mm_nt", recording_mm_nt)
        monkeypatch.setattr(backend, "_mm_nt_q", recording_mm_nt_q)
    {"forward": lambda: backend.forward(x, w), "input_grad": lambda: backend.input_grad(dy, w),
     "weight_grad": lambda: backend.weight_grad(dy, x)}[gemm]()
    return casts


@pytest.mark.parametrize("name", [n for n in CPU_BACKENDS if n != "bf16"])
@pytest.mark.parametrize("gemm", ["forward", "input_grad", "weight_grad"])
def test_declared_operand_scaling_flushes_what_the_backends_own_cast_flushes(name, gemm, monkeypatch):
    """``operand_scaling`` is what Dispatch measures the flush of: it must describe the backend's real casts."""
    from loka_trainer.probe.flush import flushed_fraction, flushed_fraction_of

    x, w, dy = _spiky(64, 256, 0), _spiky(32, 256, 1), _spiky(64, 32, 2)
    nt = {"forward": (x, w), "input_grad": (dy, w.t()), "weight_grad": (dy.t(), x.t())}[gemm]
    backend = get_backend(name)
    declared = [(op, s) for op, s in zip(nt, backend.operand_scaling(gemm)) if s is not None]
    casts = _own_casts(backend, gemm, x, w, dy, monkeypatch)
    assert len(casts) == len(declared) == (2 if backend.is_fp8(gemm) else 0)
    for (operand, s), (own_operand, q) in zip(declared, casts):
        own = float(flushed_fraction_of(own_operand, q))
        assert flushed_fraction(operand, s.granularity, s.dtype, power_of_2_scales=s.power_of_2_scales) == own
