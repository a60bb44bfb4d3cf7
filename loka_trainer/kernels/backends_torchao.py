"""FP8 backends reproducing torchao ``Float8Linear`` recipes one GEMM at a time.

Each GEMM casts its operands exactly as ``torchao.float8.float8_linear.matmul_with_hp_or_float8_args`` does
for the recipe (``Float8LinearConfig.from_recipe_name``: per-role dtype, granularity and axis) and multiplies
torchao ``Float8TrainingTensor``s with ``torch.mm`` (torchao's own ``_scaled_mm`` dispatch). Recipes:

- ``torchao_tensorwise``: y, dx, dW all FP8 with tensorwise scales (dy in e5m2).
- ``torchao_rowwise``: all three GEMMs FP8 with axiswise scales along each GEMM's contraction dim.
- ``torchao_rowwise_with_gw_hp``: y and dx rowwise FP8; dW in high precision (bf16, bitwise the BF16
  backend's), so its ``weight_grad`` is not an FP8 GEMM (``HP_GEMMS``, checked against torchao's cast configs
  by the tests).

torchao is optional: when it does not import, these backends report unavailable.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from loka_trainer.kernels.backend_base import (GEMMS, GemmBackend, GemmScaling, OperandScaling, QuantOperand,
                                              cuda_capability_at_least, emulates_fp8)

# recipe -> the GEMMs whose two operand casts are ``ScalingType.DISABLED`` (run in high precision). A table, not
# read from ``Float8LinearConfig``, because constructing a backend must not import torchao.
HP_GEMMS = {"tensorwise": (), "rowwise": (), "rowwise_with_gw_hp": ("weight_grad",)}

# GEMM -> the ``Float8LinearConfig`` cast configs of its NT operands (a, b), as the three GEMM methods below use them
CAST_CONFIGS = {
    "forward": ("cast_config_input", "cast_config_weight"),
    "input_grad": ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
    "weight_grad": ("cast_config_grad_output_for_grad_weight", "cast_config_input_for_grad_weight"),
}
# torchao's scaling granularity -> ours on the NT operand: every axiswise cast below is along the GEMM's
# contraction dim, i.e. one scale per row of the NT operand
GRANULARITIES = {"TENSORWISE": "tensorwise", "AXISWISE": "rowwise"}


def torchao_importable() -> bool:
    """True if ``torchao.float8`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("torchao") is not None


class TorchaoBackend(GemmBackend):
    """One torchao float8 training recipe, split into its three GEMMs."""

    min_multiple = 16

    def __init__(self, recipe: str) -> None:
        self.recipe = recipe
        self.name = f"torchao_{recipe}"
        self.fp8_gemms = frozenset(g for g in GEMMS if g not in HP_GEMMS[recipe])
        self._cfg = None
        self._mm_configs: dict[bool, object] = {}  # emulated? -> torchao's LinearMMConfig

    def is_available(self, device: torch.device | str) -> bool:
        if not torchao_importable():
            return False
        return torch.device(device).type == "cpu" or cuda_capability_at_least(device, 8, 9)

    def _config(self):
        if self._cfg is None:  # lazy: importing torchao is slow and optional
            from torchao.float8.config import Float8LinearConfig
            self._cfg = Float8LinearConfig.from_recipe_name(self.recipe)
        return self._cfg

    def _mm_config(self, device: torch.device):
        """torchao's per-GEMM settings as ``Float8Linear`` builds them from the recipe, with torchao's ``emulate``
        where ``emulates_fp8(device)``; built once per kind (every cast passes it)."""
        emulate = emulates_fp8(device)
        if emulate not in self._mm_configs:
            from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

            c = self._config()
            gemms = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
            self._mm_configs[emulate] = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False,
                                                                        c.pad_inner_dim) for g in gemms))
        return self._mm_configs[emulate]

    def _cast(self, t: torch.Tensor, cast_config, role: str, axis: int) -> torch.Tensor:
        """t (R, C) high precision -> Float8TrainingTensor (or bf16 when the recipe keeps it in hp)."""
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        if cast_config.scaling_type is ScalingType.DISABLED:
            return t.to(torch.bfloat16)
        cfg = self._config()
        return hp_tensor_to_float8_dynamic(
            t, cast_config.target_dtype, self._mm_config(t.device), gemm_input_role=GemmInputRole[role],
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(axis, cast_config.scaling_granularity),
            round_scales_to_power_of_2=cfg.round_scales_to_power_of_2,
        )

    def operand_scaling(self, gemm: str) -> GemmScaling:
        """The recipe's casts of ``gemm``'s NT operands (a, b), read from its ``Float8LinearConfig``; None for a
        cast the recipe disables (high precision)."""
        from torchao.float8.config import ScalingType

        def scaling(cast_config) -> Optional[OperandScaling]:
            if cast_config.scaling_type is ScalingType.DISABLED:
                return None
            return OperandScaling(GRANULARITIES[cast_config.scaling_granularity.name], cast_config.target_dtype,
                                  power_of_2_scales=config.round_scales_to_power_of_2)

        config = self._config()
        a, b = (getattr(config, attr) for attr in CAST_CONFIGS[gemm])
        return scaling(a), scaling(b)

    @staticmethod
    def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.mm(a, b)
        return out.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, w: torch.Tensor, *, w_q: Optional[QuantOperand] = None) -> torch.Tensor:
        """x (M, K), w (N, K) -> y (M, N) bf16."""
        c = self._config()
        a = self._cast(x, c.cast_config_input, "INPUT", -1)
        b = w_q[0] if w_q is not None else self._cast(w.t(), c.cast_config_weight, "WEIGHT", 0)
        return self._mm(a, b)

    def input_grad(self, dy: torch.Tensor, w: torch.Tensor, *,
                   wt_q: Optional[QuantOperand] = None) -> torch.Tensor:
        """dy (M, N), w (N, K) -> dx (M, K) bf16."""
        c = self._config()
        a = self._cast(dy, c.cast_config_grad_output, "GRAD_OUTPUT", -1)
        b = wt_q[0] if wt_q is not None else self._cast(w.t(), c.cast_config_weight_for_grad_input, "WEIGHT", -1)
        return self._mm(a, b.t())

    def weight_grad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """dy (M, N), x (M, K) -> dW (N, K) bf16."""
        c = self._config()
        a = self._cast(dy, c.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0)
        b = self._cast(x, c.cast_config_input_for_grad_weight, "INPUT", 0)
        return self._mm(a.t(), b)

    def quantize_weight_forward(self, w: torch.Tensor) -> QuantOperand:
        """w (N, K) -> the forward weight operand (wᵀ as torchao casts it), for caching per optimizer step."""
        return self._cast(w.t(), self._config().cast_config_weight, "WEIGHT", 0), None

    def quantize_weight_input_grad(self, w: torch.Tensor) -> QuantOperand:
        """w (N, K) -> the input-grad weight operand (wᵀ), for caching per optimizer step."""
        return self._cast(w.t(), self._config().cast_config_weight_for_grad_input, "WEIGHT", -1), None


def torchao_backends() -> dict[str, GemmBackend]:
    """The three torchao recipes, keyed by backend name."""
    backends = [TorchaoBackend(r) for r in HP_GEMMS]
    return {b.name: b for b in backends}
