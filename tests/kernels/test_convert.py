from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from loka_trainer.dispatch import build, calibration, convert as convert_mod
from loka_trainer.dispatch.compile import COMPILE_ENTRIES_PER_LAYER, reserve_compile_cache
from loka_trainer.dispatch.convert import PLAN_FILE
from loka_trainer.dispatch.targets import target_linears
from loka_trainer.kernels.linear import LoKALinear
from loka_trainer.precision import PrecisionConfig, apply_precision


class TinyModel(nn.Module):
    """batch dict {'dense': (B, 64), 'ids': (B, 4)} -> logits (B,)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(100, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                 nn.Linear(64, 20), nn.Linear(20, 64))  # 20 is not a multiple of 16
        self.head = nn.Linear(64, 1)

    def forward(self, batch):
        return self.head(self.mlp(batch["dense"] + self.emb(batch["ids"]))).squeeze(-1)


def _batch(b=64):
    g = torch.Generator().manual_seed(0)
    return {"dense": torch.randn(b, 64, generator=g), "ids": torch.randint(0, 100, (b, 4), generator=g)}


LOKA = dict(name="loka", compute_dtype="float32", mods=True, dispatch=True, timing_repeats=1)


def test_targets_skip_head_unaligned_and_filtered():
    m = TinyModel()
    assert set(target_linears(m, min_features=64)) == {"mlp.0", "mlp.2"}
    assert set(target_linears(m, min_features=64, module_filter_fn=lambda mod, fqn: fqn != "mlp.2")) == {"mlp.0"}


def test_fp32_and_bf16_do_nothing():
    m = TinyModel()
    before = [type(x) for x in m.modules()]
    assert apply_precision(m, config=PrecisionConfig(name="bf16", compute_dtype="bfloat16"), device="cpu") is None
    assert [type(x) for x in m.modules()] == before


def test_dispatch_settings_on_a_preset_without_dispatch_are_named_as_ignored(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    logs, m = [], TinyModel()
    config = PrecisionConfig(name="bf16", compute_dtype="bfloat16", plan=str(plan), exclude=["mlp.0"])
    assert apply_precision(m, config=config, device="cpu", log=logs.append) is None
    assert logs == ["precision=bf16: ignores precision.plan (read by Dispatch: precision=loka); precision.exclude "
                    "(read by Dispatch and the torchao presets)"]


@pytest.mark.parametrize("preset, settings, line", [
    (dict(name="bf16", compute_dtype="bfloat16"), dict(mere_threshold=0.5, min_features=16, fp8_filter="auto"),
     "precision=bf16: ignores precision.mere_threshold (read by Dispatch: precision=loka); precision.min_features "
     "(read by Dispatch and the torchao presets); precision.fp8_filter (read by the torchao presets: "
     "precision=fp8_*)"),
    (dict(name="fp8_tensorwise", compute_dtype="bfloat16", fp8_recipe="tensorwise"),
     dict(min_speedup=0.001, min_features=16, timing_rounds=1),
     "precision=fp8_tensorwise: ignores precision.min_speedup, precision.timing_rounds (read by Dispatch: "
     "precision=loka)"),
])
def test_measurement_settings_a_preset_does_not_read_are_named(preset, settings, line):
    logs = []
    apply_precision(TinyModel(), config=PrecisionConfig(**preset, **settings), device="cpu", log=logs.append)
    assert logs[0] == line
    assert not any("ignores" in entry for entry in logs[1:])


def test_loka_builds_logs_writes_and_reuses_plan(tmp_path, monkeypatch):
    m = TinyModel()
    logs = []
    plan = apply_precision(m, config=PrecisionConfig(**LOKA), device="cpu", calibration_batch=_batch(),
                           run_dir=tmp_path, log=logs.append)
    assert set(plan.layers) == {"mlp.0", "mlp.2"} and plan.layers["mlp.0"].M == 64
    for i in (0, 2):  # a LoKALinear exactly where the plan has an FP8 GEMM; all-BF16 layers stay nn.Linear
        has_fp8 = any(b != "bf16" for b in plan.layers[f"mlp.{i}"].backends().values())
        assert type(m.mlp[i]) is (LoKALinear if has_fp8 else nn.Linear)
    assert type(m.head) is nn.Linear
    assert "LoKA Dispatch plan" in logs[0] and (tmp_path / PLAN_FILE).is_file()
    # Hand-edit the written plan, then reuse it: no measurement may happen.
    d = json.loads((tmp_path / PLAN_FILE).read_text())
    d["layers"]["mlp.2"]["weight_grad"]["backend"] = "scaled_mm_tensorwise"
    (tmp_path / PLAN_FILE).write_text(json.dumps(d))
    monkeypatch.setattr(convert_mod, "build_plan", lambda *a, **k: pytest.fail("re-measured"))
    m2 = TinyModel()
    apply_precision(m2, config=PrecisionConfig(**LOKA, plan=str(tmp_path / PLAN_FILE)), device="cpu",
                    log=lambda s: None)
    assert type(m2.mlp[2]) is LoKALinear and m2.mlp[2].backends["weight_grad"] == "scaled_mm_tensorwise"
    m2(_batch()).sum().backward()


def test_exclude_keeps_layers_out_of_torchao_and_out_of_a_measured_or_loaded_plan(tmp_path, monkeypatch):
    from torchao.float8.float8_linear import Float8Linear
    m = TinyModel()
    apply_precision(m, config=PrecisionConfig(name="fp8_rowwise", fp8_recipe="rowwise", exclude=["mlp.2"]),
                    device="cpu", log=lambda s: None)
    assert isinstance(m.mlp[0], Float8Linear) and type(m.mlp[2]) is nn.Linear
    fp8 = dict(LOKA, min_speedup=1e-6, backends=["bf16", "scaled_mm_tensorwise"])  # every accurate GEMM FP8 on CPU
    plan = apply_precision(TinyModel(), config=PrecisionConfig(**fp8, exclude=["mlp.[2-9]"]), device="cpu",
                           calibration_batch=_batch(), run_dir=tmp_path, log=lambda s: None)
    assert set(plan.layers) == {"mlp.0"}
    full = apply_precision(TinyModel(), config=PrecisionConfig(**fp8), device="cpu", calibration_batch=_batch(),
                           run_dir=tmp_path / "full", log=lambda s: None)
    assert set(full.layers) == {"mlp.0", "mlp.2"}
    assert any(b != "bf16" for b in full.layers["mlp.2"].backends().values())
    # The full plan loaded with mlp.2 excluded: that layer runs BF16, the run keeps the file as it was.
    monkeypatch.setattr(convert_mod, "build_plan", lambda *a, **k: pytest.fail("re-measured"))
    m2, run_dir, logs = TinyModel(), tmp_path / "reused", []
    loaded = apply_precision(m2, config=PrecisionConfig(**fp8, plan=str(tmp_path / "full" / PLAN_FILE),
                                                        exclude=["mlp.2"]), device="cpu", run_dir=run_dir,
                             log=logs.append)
    assert "exclude ['mlp.2']: 1 target Linear(s) stay BF16: mlp.2" in logs
    assert set(loaded.layers) == {"mlp.0"} and type(m2.mlp[2]) is nn.Linear and type(m2.mlp[0]) is LoKALinear
    assert (run_dir / PLAN_FILE).read_bytes() == (tmp_path / "full" / PLAN_FILE).read_bytes()
    with pytest.raises(ValueError, match=r"exclude: \['mlp.9'\] name\(s\) no FP8 target"):
        apply_precision(TinyModel(), config=PrecisionConfig(**fp8, exclude=["mlp.9"]), device="cpu",
                        calibration_batch=_batch(), log=lambda s: None)


class DeclaresBF16(TinyModel):
    """TinyModel whose ``mlp`` names its second Linear as one Dispatch must keep BF16 (``loka_keep_bf16``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp.loka_keep_bf16 = ("2",)  # relative to the module that declares it: mlp.2


def test_a_linear_the_model_declares_bf16_stays_out_of_dispatch_and_of_a_loaded_plan_but_not_torchao(tmp_path,
                                                                                                      monkeypatch):
    from torchao.float8.float8_linear import Float8Linear

    from loka_trainer.dispatch.targets import declared_bf16
    assert declared_bf16(DeclaresBF16()) == ["mlp.2"] and declared_bf16(TinyModel()) == []
    fp8 = dict(LOKA, min_speedup=1e-6, backends=["bf16", "scaled_mm_tensorwise"])  # every accurate GEMM FP8 on CPU
    m, logs = DeclaresBF16(), []
    plan = apply_precision(m, config=PrecisionConfig(**fp8), device="cpu", calibration_batch=_batch(),
                           run_dir=tmp_path / "kept", log=logs.append)
    assert set(plan.layers) == {"mlp.0"} and type(m.mlp[2]) is nn.Linear and type(m.mlp[0]) is LoKALinear
    assert any("1 Linear(s) the model keeps BF16 (loka_keep_bf16" in line and "mlp.2" in line for line in logs)
    free = apply_precision(DeclaresBF16(), config=PrecisionConfig(**fp8, keep_declared_bf16=False), device="cpu",
                           calibration_batch=_batch(), run_dir=tmp_path / "free", log=lambda s: None)
    assert set(free.layers) == {"mlp.0", "mlp.2"}
    # A plan measured without the declaration (an older plan) loses that layer on load, unless told otherwise.
    monkeypatch.setattr(convert_mod, "build_plan", lambda *a, **k: pytest.fail("re-measured"))
    old_plan = str(tmp_path / "free" / PLAN_FILE)
    m2 = DeclaresBF16()
    loaded = apply_precision(m2, config=PrecisionConfig(**fp8, plan=old_plan), device="cpu", log=lambda s: None)
    assert set(loaded.layers) == {"mlp.0"} and type(m2.mlp[2]) is nn.Linear
    as_saved = apply_precision(DeclaresBF16(), config=PrecisionConfig(**fp8, plan=old_plan, keep_declared_bf16=False),
                               device="cpu", log=lambda s: None)
    assert set(as_saved.layers) == {"mlp.0", "mlp.2"}
    m3 = DeclaresBF16()  # torchao's uniform recipe is the baseline as torchao applies it: the declaration is ours
    apply_precision(m3, config=PrecisionConfig(name="fp8_rowwise", fp8_recipe="rowwise"), device="cpu",
                    log=lambda s: None)
    assert isinstance(m3.mlp[2], Float8Linear)


def test_interformer_declares_its_weight_generators_bf16():
    from loka_trainer.dispatch.targets import declared_bf16
    from loka_trainer.models.interformer_arches import SequenceArch
    from loka_trainer.models.mods import LOKA_MODS

    arch = nn.ModuleDict({"seq_arch": SequenceArch(2, 16, 2, [32], LOKA_MODS)})
    assert declared_bf16(arch) == ["seq_arch.personal_weight"]


@pytest.fixture
def dynamo_config():
    """torch._dynamo.config with its limits restored afterwards (monkeypatch would delete config entries)."""
    import torch._dynamo.config as cfg
    saved = cfg.recompile_limit, cfg.accumulated_recompile_limit
    cfg.recompile_limit = 8
    yield cfg
    cfg.recompile_limit, cfg.accumulated_recompile_limit = saved


def test_input_capture_leaves_the_forward_unchanged_for_token_inputs():
    class Tokens(TinyModel):  # mlp.0 sees (B, T, 64) tokens, as attention / InterFormer layers do
        def forward(self, batch):
            tokens = (batch["dense"] + self.emb(batch["ids"])).unsqueeze(1).expand(-1, 3, -1)
            return self.head(self.mlp(tokens).mean(1)).squeeze(-1)

    m = Tokens()
    expected = m(_batch())
    captured = calibration.capture_linear_inputs(m, target_linears(m, min_features=64), _batch())
    assert captured["mlp.0"].shape == (64 * 3, 64)  # flattened to (M, K) for Dispatch
    assert calibration.linear_input_rows(m, target_linears(m, min_features=64), _batch())["mlp.0"] == {192}
    torch.testing.assert_close(m(_batch()), expected)  # the hooks are gone and changed nothing
    plan = apply_precision(m, config=PrecisionConfig(**LOKA), device="cpu", calibration_batch=_batch(),
                           log=lambda s: None)
    assert plan.layers["mlp.0"].M == 192


def test_calibration_leaves_batchnorm_statistics_and_the_random_state_as_they_were():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), nn.Linear(64, 64))
    before, batch = {name: b.clone() for name, b in m.named_buffers()}, torch.randn(32, 64)
    rng = torch.get_rng_state()
    captured = calibration.capture_linear_inputs(m, target_linears(m, min_features=64), batch)
    assert set(captured) == {"0", "3"} and (captured["3"] == 0).any()  # Dropout was on: train mode's inputs
    assert all(torch.equal(b, before[name]) for name, b in m.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


def test_compile_step_reserves_one_compiled_graph_per_lokalayer_and_conversion_leaves_dynamo_alone(dynamo_config):

    class Deep(TinyModel):  # 12 planned layers: more than dynamo's default 8 graphs per frame
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(*[nn.Linear(64, 64) for _ in range(12)])

    logs = []
    deep = Deep()
    plan = apply_precision(deep, config=PrecisionConfig(**LOKA, backends=["scaled_mm_rowwise"], min_speedup=1e-9),
                           device="cpu", calibration_batch=_batch(), log=logs.append)
    assert len(plan.layers) == 12
    assert dynamo_config.recompile_limit == 8  # converting changes no process-wide setting
    reserve_compile_cache(deep, logs.append)  # the trainer's compile step
    num_loka = sum(isinstance(m, LoKALinear) for m in deep.modules())
    assert num_loka == 12
    assert dynamo_config.recompile_limit == COMPILE_ENTRIES_PER_LAYER * 12
    assert any("recompile_limit raised to 48" in line for line in logs)
    reserve_compile_cache(nn.Sequential(LoKALinear(64, 64)), logs.append)
    assert dynamo_config.recompile_limit == 48  # a smaller model never lowers it


def test_plan_for_other_model_rejected(tmp_path):
    m = TinyModel()
    apply_precision(m, config=PrecisionConfig(**LOKA), device="cpu", calibration_batch=_batch(), run_dir=tmp_path,
                    log=lambda s: None)
    other = TinyModel()
    other.mlp[2] = nn.Linear(128, 96)
    with pytest.raises(ValueError, match="layer 'mlp.2' has shape"):
        apply_precision(other, config=PrecisionConfig(**LOKA, plan=str(tmp_path / PLAN_FILE)), device="cpu",
                        log=lambda s: None)


def test_dispatch_without_batch_or_plan_is_a_clear_error():
    with pytest.raises(ValueError, match="calibration batch or a plan file"):
        apply_precision(TinyModel(), config=PrecisionConfig(**LOKA), device="cpu", log=lambda s: None)


def test_converted_model_saved_loads_into_bf16_model(tmp_path):
    torch.manual_seed(0)
    m = TinyModel()
    apply_precision(m, config=PrecisionConfig(**LOKA), device="cpu", calibration_batch=_batch(), log=lambda s: None)
    torch.save(m.state_dict(), tmp_path / "ckpt.pt")
    plain = TinyModel().to(torch.bfloat16)
    plain.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert torch.equal(plain.mlp[0].weight, m.mlp[0].weight.to(torch.bfloat16))
    b = _batch()
    b["dense"] = b["dense"].to(torch.bfloat16)
    assert torch.isfinite(plain(b)).all()


def test_plan_timers_follow_the_two_config_fields_on_cuda_and_wall_clock_elsewhere(monkeypatch):
    from loka_trainer import timing
    made = []
    fake = {name: (lambda name=name: made.append(name) or name) for name in ("cuda_events", "cuda_graph")}
    monkeypatch.setattr(timing, "GPU_TIMERS", fake)
    cfg = PrecisionConfig(name="loka", mods=True, dispatch=True)
    assert build.plan_timers(cfg, "cuda") == ("cuda_events", "cuda_graph")  # the defaults
    cfg.gpu_timer, cfg.layer_timer = "cuda_graph", "cuda_events"
    assert build.plan_timers(cfg, torch.device("cuda", 0)) == ("cuda_graph", "cuda_events")
    gemm, layer = build.plan_timers(cfg, "cpu")
    assert made == ["cuda_events", "cuda_graph", "cuda_graph", "cuda_events"]  # no GPU timer built for the CPU
    assert gemm(lambda: sum(range(100))) > 0 and layer(lambda: None) >= 0


def _mods_mlp() -> nn.Module:
    from loka_trainer.mods.transform import apply_mods

    model = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.SiLU(), nn.Linear(512, 256))
    apply_mods(model)  # BlockNorm's blocks of 256: N = 512 fuses
    return model


@pytest.mark.parametrize("make, batch, extra", [
    (TinyModel, _batch, dict(min_speedup=0.001)),  # FP8 GEMMs: LoKALinears
    (_mods_mlp, lambda: torch.randn(64, 256), {}),  # the Mods: a FusedLinearMods, every GEMM BF16
], ids=["lokalinear", "fused_mods"])
def test_a_model_is_converted_once_a_second_conversion_is_refused_and_changes_nothing(tmp_path, make, batch, extra):
    from loka_trainer import LoKAConfig, convert_to_loka

    model = make()
    config = LoKAConfig(compute_dtype="float32", timing_repeats=1, timing_rounds=1, min_features=16, **extra)
    convert_to_loka(model, config, calibration_batch=batch(), device="cpu", run_dir=tmp_path, log=lambda s: None)
    before, plan_bytes = repr(model), (tmp_path / PLAN_FILE).read_bytes()
    assert "LoKALinear" in before or "FusedLinearMods" in before
    with pytest.raises(ValueError, match=r"the model already holds \d+ LoKA layer\(s\) .*converts a model once"):
        convert_to_loka(model, config, calibration_batch=batch(), device="cpu", run_dir=tmp_path,
                        log=lambda s: None)
    assert repr(model) == before and (tmp_path / PLAN_FILE).read_bytes() == plan_bytes


def test_an_exclude_typo_names_the_closest_targets_not_every_one():
    from loka_trainer.dispatch.targets import check_exclude
    targets = [f"layers.{i}.seq_arch.personal_weight" for i in range(3)] + [f"layers.{i}.out" for i in range(60)]
    with pytest.raises(ValueError) as typo:
        check_exclude(["layers.*.seq_arch.personal_weigth"], targets, where="precision")
    message = str(typo.value)
    assert "closest of its 63 targets" in message and "layers.0.seq_arch.personal_weight" in message
    assert "layers.5.out" not in message
    with pytest.raises(ValueError, match=r"none is close among its 63 targets, e.g. \['layers.0.out'"):
        check_exclude(["zzz"], targets, where="precision")
    with pytest.raises(ValueError) as none:  # a model without FP8 targets
        check_exclude(["mlp.0"], [], where="precision")
    assert str(none.value) == "precision.exclude: ['mlp.0'] name(s) no FP8 target of this model; it has no targets"
