from __future__ import annotations

import json

import pytest

from loka_trainer.dispatch.plan import (
    DispatchPlan, GemmChoice, LayerPlan, load_plan, save_plan, validate_plan,
)
from loka_trainer.dispatch.plan_table import format_plan_table

VALID = ["bf16", "scaled_mm_rowwise", "scaled_mm_tensorwise"]


def _plan() -> DispatchPlan:
    lp = LayerPlan(M=256, K=128, N=64,
                   forward=GemmChoice("scaled_mm_rowwise", mere=0.03, flushed=0.002, time_us=8.0, bf16_time_us=10.0,
                                      candidates={"scaled_mm_rowwise": {"mere": 0.03, "flushed": 0.002, "time_us": 8.0,
                                                                       "times_us": [8.0, 7.9, 8.3]},
                                                  "scaled_mm_tensorwise": {"mere": 0.02, "flushed": 0.84,
                                                                           "time_us": 7.0}}),
                   input_grad=GemmChoice("bf16", mere=0.002, time_us=10.0, bf16_time_us=10.0))
    return DispatchPlan(device="cpu", layers={"dense.mlp.0": lp, "over.1": LayerPlan(M=256, K=64, N=64)},
                        max_flushed_fraction=0.05)


def test_round_trip(tmp_path):
    plan = _plan()
    path = save_plan(plan, tmp_path / "sub" / "dispatch_plan.json")
    back = load_plan(path)
    assert back.to_dict() == plan.to_dict()
    assert back.max_flushed_fraction == 0.05
    assert back.layers["dense.mlp.0"].forward.flushed == 0.002
    assert back.layers["dense.mlp.0"].forward.candidates["scaled_mm_tensorwise"]["flushed"] == 0.84
    assert back.layers["dense.mlp.0"].forward.speedup == pytest.approx(1.25)
    assert back.layers["over.1"].backends() == {"forward": "bf16", "input_grad": "bf16", "weight_grad": "bf16"}


def test_hand_edited_minimal_plan_loads(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "layers": {"a": {"shape": {"M": 8, "K": 64, "N": 32},
                                                              "weight_grad": {"backend": "scaled_mm_tensorwise"}}}}))
    plan = load_plan(path)
    assert plan.layers["a"].backends()["weight_grad"] == "scaled_mm_tensorwise"
    assert plan.layers["a"].forward.backend == "bf16"
    validate_plan(plan, {"a": (64, 32)}, VALID)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["layers"].update({"ghost": d["layers"]["over.1"]}), "unknown layer 'ghost'"),
    (lambda d: d["layers"]["over.1"]["forward"].update(backend="cublas_fp4"), "backend 'cublas_fp4'"),
    (lambda d: d["layers"]["over.1"]["shape"].update(K=96), "K=96, N=64 but the model's is K=64"),
])
def test_bad_plan_rejected_against_model(tmp_path, mutate, match):
    d = _plan().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match):
        validate_plan(load_plan(path), {"dense.mlp.0": (128, 64), "over.1": (64, 64)}, VALID)


@pytest.mark.parametrize("content,match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"version": 7, "layers": {}}), "version must be 1"),
    (json.dumps({"version": 1, "layers": {"a": {"shape": {"M": 1, "K": "x", "N": 2}}}}), "integer M, K, N"),
    (json.dumps({"version": 1, "layers": {"a": {"shape": {"M": 1, "K": 2, "N": 2}, "forward": {}}}}),
     "string 'backend'"),
])
def test_malformed_plan_file(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_plan(path)


def test_missing_file_message(tmp_path):
    with pytest.raises(ValueError, match="precision.plan: file .* does not exist"):
        load_plan(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="^LoKAConfig.plan: file .* does not exist"):  # as the API user named it
        load_plan(tmp_path / "nope.json", where="LoKAConfig.plan")


def test_table_lists_every_gemm():
    table = format_plan_table(_plan())
    assert "scaled_mm_rowwise" in table and "1.25" in table
    assert table.count("weight_grad") == 2
    assert "1 of 6 GEMMs in FP8" in table


def test_table_prints_whole_layer_names_in_aligned_columns():
    plan = _plan()
    long_name = "layers.0.cross_arch.pma.attention.q_with_a_long_suffix"
    plan.layers[long_name] = plan.layers.pop("over.1")
    lines = format_plan_table(plan).splitlines()
    row = next(line for line in lines if line.startswith(long_name + " "))
    header = next(line for line in lines if line.startswith("layer "))
    assert row.index("256×64×64") + len("256×64×64") == header.index("M×K×N") + len("M×K×N")


def test_a_plan_without_the_flush_fields_loads_with_the_default(tmp_path):
    from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION
    d = _plan().to_dict()
    del d["max_flushed_fraction"]
    del d["layers"]["dense.mlp.0"]["forward"]["flushed"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    back = load_plan(path)
    assert back.max_flushed_fraction == DEFAULT_MAX_FLUSHED_FRACTION
    assert back.layers["dense.mlp.0"].forward.flushed is None


def test_table_names_the_candidates_rejected_for_flushing():
    table = format_plan_table(_plan())
    assert "flushed <= 0.05" in table.splitlines()[0]
    assert "rejected, flushed > 0.05: scaled_mm_tensorwise 0.8400" in table
    assert "1 GEMM(s) with an FP8 candidate rejected for flushing" in table


def test_bf16_rows_say_why():
    from loka_trainer.dispatch.plan_table import bf16_reason, bf16_reason_counts
    inaccurate = GemmChoice("bf16", mere=0.002, time_us=10.0, bf16_time_us=10.0,
                            candidates={"scaled_mm_rowwise": {"mere": 0.4, "time_us": 5.0},
                                        "bf16": {"mere": 0.002, "time_us": 10.0}})
    slow = GemmChoice("bf16", mere=0.002, time_us=10.0, bf16_time_us=10.0,
                      candidates={"scaled_mm_rowwise": {"mere": 0.4, "time_us": 5.0},
                                  "scaled_mm_tensorwise": {"mere": 0.05, "time_us": 9.9}})
    kw = dict(mere_threshold=0.2, min_speedup=1.05)
    assert bf16_reason(inaccurate, **kw) == "MERE" and bf16_reason(slow, **kw) == "slow"
    assert bf16_reason(GemmChoice("bf16"), **kw) == "unmeasured"
    assert bf16_reason(GemmChoice("scaled_mm_rowwise", candidates=slow.candidates), **kw) is None
    plan = DispatchPlan(device="cpu", layers={"a": LayerPlan(M=16, K=16, N=16, forward=inaccurate, input_grad=slow)})
    assert bf16_reason_counts(plan) == {"MERE": 1, "flushed": 0, "slow": 1, "unmeasured": 1, "hp": 0}
    assert "0 of 3 GEMMs in FP8; BF16 kept for 1 (no FP8 candidate with MERE < 0.2), 0 (the others flush > 0.01 " \
           "of an operand to zero), 1 (no accurate one" in format_plan_table(plan)
    # the MERE-accurate candidate flushes too much, the other fails MERE: kept BF16 for flushing
    flushing = GemmChoice("bf16", bf16_time_us=10.0,
                          candidates={"scaled_mm_rowwise": {"mere": 0.4, "time_us": 5.0},
                                      "scaled_mm_tensorwise": {"mere": 0.05, "flushed": 0.5, "time_us": 5.0}})
    assert bf16_reason(flushing, **kw) == "flushed"
    assert bf16_reason(flushing, **kw, max_flushed_fraction=0.5) == "slow"  # at the limit: not rejected


def test_mods_forward_round_trips(tmp_path):
    from loka_trainer.dispatch.plan import ModsChoice
    plan = _plan()
    plan.layers["dense.mlp.0"].mods_forward = ModsChoice("split_fp8", {"split_bf16": 10.0, "split_fp8": 7.0}, 1.43)
    back = load_plan(save_plan(plan, tmp_path / "p.json"))
    assert back.to_dict() == plan.to_dict() and back.layers["dense.mlp.0"].mods_forward.mode == "split_fp8"
    assert back.layers["over.1"].mods_forward is None


@pytest.mark.parametrize("mode,forward_fp8", [("split_bf16", False), ("fused_bf16", False), ("split_fp8", True)])
def test_fp8_count_follows_the_mods_forward_mode(mode, forward_fp8):
    from loka_trainer.dispatch.plan import ModsChoice
    from loka_trainer.dispatch.plan_table import num_fp8_gemms
    plan = _plan()
    lp = plan.layers["dense.mlp.0"]
    assert lp.forward.backend != "bf16" and num_fp8_gemms(plan) == 1
    lp.mods_forward = ModsChoice(mode, {"split_bf16": 10.0, mode: 9.0}, 1.0)
    assert lp.runs_fp8()["forward"] is forward_fp8 and lp.runs_fp8()["weight_grad"] is False
    assert num_fp8_gemms(plan) == int(forward_fp8)
    assert f"{int(forward_fp8)} of 6 GEMMs in FP8" in format_plan_table(plan)
    assert f"{int(not forward_fp8)} (fused Mods layer timed faster in BF16)" in format_plan_table(plan)


def _with_mods_input_grad(backend: str, mere: float = 0.01) -> DispatchPlan:
    from loka_trainer.dispatch.plan import ModsChoice
    plan = _plan()
    lp = plan.layers["dense.mlp.0"]
    lp.input_grad.candidates = {"scaled_mm_rowwise": {"mere": mere, "time_us": 10.5}}
    lp.mods_input_grad = ModsChoice(backend, {"bf16": 82.6, "scaled_mm_rowwise": 77.6}, 1.06)
    return plan


def test_mods_input_grad_round_trips_and_counts_as_fp8(tmp_path):
    plan = _with_mods_input_grad("scaled_mm_rowwise")
    back = load_plan(save_plan(plan, tmp_path / "p.json"))
    assert back.to_dict() == plan.to_dict()
    lp = back.layers["dense.mlp.0"]
    # the per-GEMM choice stays BF16 (the dgrad timed alone was not fast enough), the fused layer runs FP8
    assert lp.input_grad.backend == "bf16" and lp.runs_fp8()["input_grad"] is True
    table = format_plan_table(back)
    assert "mods dgrad  scaled_mm_rowwise" in table and "1.06" in table
    assert "2 of 6 GEMMs in FP8" in table and "1 (no accurate one" not in table  # not also counted as kept BF16
    validate_plan(back, {"dense.mlp.0": (128, 64), "over.1": (64, 64)}, VALID)


def test_mods_input_grad_bf16_over_an_fp8_plan_choice_is_counted_as_timed_bf16():
    plan = _with_mods_input_grad("bf16")
    plan.layers["dense.mlp.0"].input_grad.backend = "scaled_mm_rowwise"
    assert plan.layers["dense.mlp.0"].runs_fp8()["input_grad"] is False
    assert "1 of 6 GEMMs in FP8" in format_plan_table(plan)
    assert "1 (fused Mods layer timed faster in BF16)" in format_plan_table(plan)


@pytest.mark.parametrize("backend, mere, match", [("fp16_magic", 0.01, "mods_input_grad: backend 'fp16_magic'"),
                                                  ("scaled_mm_rowwise", 0.5, "input-grad MERE 0.5 >= 0.2")])
def test_bad_mods_input_grad_is_rejected(backend, mere, match):
    with pytest.raises(ValueError, match=match):
        validate_plan(_with_mods_input_grad(backend, mere), {"dense.mlp.0": (128, 64), "over.1": (64, 64)}, VALID)


def test_a_mods_input_grad_that_flushes_too_much_is_rejected():
    plan = _with_mods_input_grad("scaled_mm_rowwise")
    plan.layers["dense.mlp.0"].input_grad.candidates["scaled_mm_rowwise"]["flushed"] = 0.3
    with pytest.raises(ValueError, match="flushes 0.3 of an operand's nonzeros to zero, > max_flushed_fraction 0.05"):
        validate_plan(plan, {"dense.mlp.0": (128, 64), "over.1": (64, 64)}, VALID)


@pytest.mark.parametrize("content,match", [
    (b"\xff\xfe\x00garbage\x80", "not UTF-8 text"),
    (b"[]", "must be a JSON object with 'version' and 'layers', got list"),
    (b'"a plan"', "must be a JSON object"),
    (json.dumps({"version": True, "layers": {}}).encode(), "version must be 1"),
    (json.dumps({"version": 1, "layers": []}).encode(), "'layers' must be an object"),
    (json.dumps({"version": 1, "layers": {"a": []}}).encode(), "layer 'a': needs a 'shape'"),
    (json.dumps({"version": 1, "layers": {"a": {"shape": {"M": 8, "K": 64, "N": 32},
                                                "forward": {"backend": "bf16", "mere": "low"}}}}).encode(),
     "'forward' 'mere' must be a number or null, got 'low'"),
    (json.dumps({"version": 1, "layers": {"a": {"shape": {"M": 8, "K": 64, "N": 32},
                                                "forward": {"backend": "bf16", "candidates": [1]}}}}).encode(),
     "'candidates' must be an object"),
    (json.dumps({"version": 1, "layers": {"a": {"shape": {"M": 8, "K": 64, "N": 32},
                                                "mods_forward": {"mode": "fused_bf16", "times_us": [3]}}}}).encode(),
     "'mods_forward' times_us must be an object of numbers"),
    (json.dumps({"version": 1, "mere_threshold": "strict", "layers": {}}).encode(),
     "'mere_threshold' must be a number, got 'strict'"),
    (json.dumps({"version": 1, "mere_threshold": -1, "layers": {}}).encode(),
     "'mere_threshold' must be a finite number > 0, got -1.0"),
    (json.dumps({"version": 1, "min_speedup": float("nan"), "layers": {}}).encode(),
     "'min_speedup' must be a finite number > 0, got nan"),
    (json.dumps({"version": 1, "max_flushed_fraction": 2, "layers": {}}).encode(),
     "'max_flushed_fraction' must be within \\[0, 1\\], got 2.0"),
    (json.dumps({"version": 1, "layers": {"a": {"shape": {"M": 8, "K": 64, "N": 32}, "forward": {
        "backend": "scaled_mm_rowwise", "mere": float("nan")}}}}).encode(),
     "layer 'a': 'forward' runs scaled_mm_rowwise with MERE nan: a damaged plan"),
])
def test_plan_file_of_the_wrong_kind_is_one_value_error_naming_the_file(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        load_plan(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_plan_of_another_model_names_the_file_and_the_model_layers():
    with pytest.raises(ValueError, match="unknown layer .*, not a target of this model") as err:
        validate_plan(_plan(), {"layers.0.mlp": (128, 64)}, VALID, source="precision.plan 'x.json'")
    assert str(err.value).startswith("precision.plan 'x.json': ") and "layers.0.mlp" in str(err.value)
