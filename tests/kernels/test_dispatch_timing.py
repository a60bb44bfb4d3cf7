"""Dispatch's timing rule: interleaved rounds, outliers re-timed, a win in every round; and a backend's
high-precision GEMM is BF16 (counts, table, choice)."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.dispatch.measure import build_layer_plan, time_rounds
from loka_trainer.dispatch.plan import DispatchPlan, GemmChoice, LayerPlan
from loka_trainer.dispatch.plan_table import format_plan_table, num_fp8_gemms
from loka_trainer.dispatch.select import outlier_rounds, select_backend, wins_every_round
from loka_trainer.kernels.backends import available_backends, get_backend

RULE = dict(mere_threshold=0.2, min_speedup=1.05)
GW_HP = "torchao_rowwise_with_gw_hp"


def _backend_of(fn):
    return fn.__closure__[0].cell_contents.name  # measure._gemm_call's lambda captures the backend first


def _sequence_timer(times_by_backend: dict[str, list[float]]):
    """Reports each backend's injected times in order, then repeats its last one."""
    seen: dict[str, int] = {}

    def timer(fn):
        name = _backend_of(fn)
        i = seen[name] = seen.get(name, -1) + 1
        seq = times_by_backend[name]
        return seq[min(i, len(seq) - 1)]
    return timer


def test_one_bf16_outlier_round_does_not_put_an_accurate_enough_gemm_on_fp8():
    """The real case: BF16 timed 7892 µs once among 36-70 µs; MERE 0.136 passes the 0.2 threshold, so only the
    timing rule can keep this GEMM in BF16."""
    cands = {"scaled_mm_rowwise": {"mere": 0.136, "time_us": 60.0, "times_us": [60.0, 58.0, 61.0]}}
    assert select_backend(cands, [48.0, 7892.0, 52.0], **RULE) == "bf16"


def test_a_bf16_outlier_is_re_timed_when_measuring():
    torch.manual_seed(0)
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    backends = {k: get_backend(k) for k in ("bf16", "scaled_mm_rowwise")}
    timer = _sequence_timer({"bf16": [7892.0, 50.0, 52.0, 49.0], "scaled_mm_rowwise": [60.0]})
    lp = build_layer_plan(x, w, backends, timer=timer, forward_mere={"scaled_mm_rowwise": 0.136}, rounds=3,
                          outlier_factor=3.0, **RULE)
    assert lp.forward.backend == "bf16"
    assert lp.forward.candidates["bf16"]["times_us"] == [49.0, 50.0, 52.0]  # the 7892 round timed again
    assert lp.forward.bf16_time_us == 50.0


def test_a_candidate_winning_two_of_three_rounds_is_not_chosen():
    bf16 = [100.0, 100.0, 100.0]
    lucky = {"a": {"mere": 0.01, "time_us": 80.0, "times_us": [80.0, 80.0, 101.0]}}  # median 1.25x faster
    assert select_backend(lucky, bf16, **RULE) == "bf16"
    steady = {"a": {"mere": 0.01, "time_us": 90.0, "times_us": [80.0, 90.0, 94.0]}}  # > 1.05x in every round
    assert select_backend(steady, bf16, **RULE) == "a"
    assert not wins_every_round([80.0, 96.0], [100.0, 100.0], 1.05)  # the second timing is only 1.04x


@pytest.mark.parametrize("times,expected", [
    ([50.0, 7892.0, 52.0], [1]), ([36.0, 70.0, 52.0], []), ([10.0, 31.0], [1]), ([10.0], []),
])
def test_outlier_rounds(times, expected):
    assert outlier_rounds(times, 3.0) == expected


def test_rounds_interleave_every_candidate_in_rotated_order():
    order = []
    calls = {n: (lambda n=n: n) for n in "abc"}
    times = time_rounds(calls, lambda fn: (order.append(fn()), 1.0)[1], rounds=3)
    assert order == list("abc" "bca" "cab")
    assert times == {n: [1.0, 1.0, 1.0] for n in "abc"}


def test_a_high_precision_gemm_of_an_fp8_recipe_is_bf16():
    pytest.importorskip("torchao")
    from torchao.float8.config import Float8LinearConfig, ScalingType

    from loka_trainer.kernels.backends_torchao import HP_GEMMS
    operand_casts = {"forward": ("cast_config_input", "cast_config_weight"),
                     "input_grad": ("cast_config_grad_output", "cast_config_weight_for_grad_input"),
                     "weight_grad": ("cast_config_grad_output_for_grad_weight", "cast_config_input_for_grad_weight")}
    for recipe, hp in HP_GEMMS.items():  # the table agrees with torchao's own recipe
        cfg = Float8LinearConfig.from_recipe_name(recipe)
        disabled = {g for g, casts in operand_casts.items()
                    if all(getattr(cfg, c).scaling_type is ScalingType.DISABLED for c in casts)}
        assert disabled == set(hp), recipe
    gw_hp, bf16 = get_backend(GW_HP), get_backend("bf16")
    assert [gw_hp.is_fp8(g) for g in ("forward", "input_grad", "weight_grad")] == [True, True, False]
    assert not bf16.is_fp8("forward") and get_backend("scaled_mm_rowwise").is_fp8("weight_grad")
    torch.manual_seed(0)
    dy, x = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16)
    assert torch.equal(gw_hp.weight_grad(dy, x), bf16.weight_grad(dy, x))  # bitwise BF16


def test_plan_counts_and_labels_a_high_precision_gemm_as_bf16():
    lp = LayerPlan(M=64, K=64, N=64, forward=GemmChoice(GW_HP), input_grad=GemmChoice(GW_HP),
                   weight_grad=GemmChoice(GW_HP))
    plan = DispatchPlan(device="cpu", layers={"a": lp})
    assert lp.runs_fp8() == {"forward": True, "input_grad": True, "weight_grad": False}
    assert num_fp8_gemms(plan) == 2
    table = format_plan_table(plan)
    assert "2 of 3 GEMMs in FP8" in table and "1 (backend runs it in BF16)" in table
    [wgrad_row] = [r for r in table.splitlines() if "weight_grad" in r]
    assert f"bf16 (via {GW_HP})" in wgrad_row and wgrad_row.rstrip().endswith("hp")


def test_dispatch_never_chooses_a_high_precision_gemm_over_bf16_on_timing():
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    backends = {k: v for k, v in available_backends("cpu").items() if k in ("bf16", GW_HP)}
    times = {"bf16": [100.0], GW_HP: [50.0]}  # the high-precision weight grad "2x faster": noise
    lp = build_layer_plan(x, w, backends, timer=_sequence_timer(times), mere_threshold=1.0, min_speedup=1.05)
    assert lp.forward.backend == GW_HP  # its FP8 GEMMs stay candidates
    assert lp.weight_grad.backend == "bf16" and GW_HP not in lp.weight_grad.candidates
