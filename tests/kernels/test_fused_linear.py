"""FusedLinearMods and the Linear -> BlockNorm -> HardSwish transform (CPU: the unfused math, FP8 GEMMs as planned)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from loka_trainer.dispatch.convert import kernels_from_plan_backends
from loka_trainer.kernels.linear import WeightCache
from loka_trainer.models.layers import mlp
from loka_trainer.mods.module import FusedLinearMods
from loka_trainer.mods.transform import find_fusable, fuse_linear_mods
from loka_trainer.precision import PrecisionConfig, apply_precision


def _mlp(**kw):
    torch.manual_seed(0)
    args = dict(bias=False, norm="blocknorm", activation="hardswish", block_size=256)
    args.update(kw)
    return nn.Sequential(nn.Sequential(mlp(64, [512, 256], **args)), nn.Linear(256, 1))


def test_fuses_mods_triples_keeps_state_dict_and_outputs():
    model = _mlp()
    ref = copy.deepcopy(model)
    w0 = model[0][0][0].weight
    assert fuse_linear_mods(model) == ["0.0.0", "0.0.3"]
    inner = model[0][0]
    assert isinstance(inner[0], FusedLinearMods) and inner[0].weight is w0  # same Parameter object
    assert isinstance(inner[1], nn.Identity) and isinstance(inner[5], nn.Identity)
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(16, 64, requires_grad=True)
    torch.testing.assert_close(model(x), ref(x))
    model(x).sum().backward()
    assert w0.grad is not None and torch.isfinite(w0.grad).all()
    ref.load_state_dict(model.state_dict())  # checkpoint of the fused model loads into the plain one


@pytest.mark.parametrize("kw", [dict(bias=True), dict(norm="layernorm"), dict(activation="silu"),
                                dict(block_size=128 + 64)])
def test_published_or_unsupported_layers_are_not_fused(kw):
    assert find_fusable(_mlp(**kw)) == {}


def test_filter_and_kernels():
    model = _mlp()
    fused = fuse_linear_mods(model, kernels={"0.0.3": {"mode": "split_bf16", "wgrad": "scaled_mm_rowwise"}},
                             module_filter_fn=lambda mod, fqn: mod.out_features == 256)
    assert fused == ["0.0.3"] and model[0][0][3].mode == "split_bf16" and model[0][0][3].wgrad == "scaled_mm_rowwise"
    with pytest.raises(ValueError, match="mode"):
        model[0][0][3].set_kernels(mode="nope", dgrad="bf16", wgrad="bf16")
    with pytest.raises(ValueError, match="backend"):
        model[0][0][3].set_kernels(mode="fused_bf16", dgrad="nope", wgrad="bf16")


def test_plan_backends_map_to_kernels():
    assert kernels_from_plan_backends({"forward": "bf16", "input_grad": "bf16", "weight_grad": "bf16"}) == \
        {"mode": "split_bf16", "dgrad": "bf16", "wgrad": "bf16"}
    k = kernels_from_plan_backends({"forward": "torchao_rowwise", "input_grad": "scaled_mm_rowwise",
                                    "weight_grad": "bf16"})
    assert k == {"mode": "fused_fp8", "dgrad": "scaled_mm_rowwise", "wgrad": "bf16"}


def test_apply_precision_loka_with_mods_fuses_after_dispatch():
    model = _mlp()
    keys = list(model.state_dict())
    cfg = PrecisionConfig(name="loka", mods=True, dispatch=True, timing_repeats=1, backends=["scaled_mm_rowwise"])
    logs = []
    plan = apply_precision(model, config=cfg, device="cpu", calibration_batch=torch.randn(32, 64), log=logs.append)
    assert set(plan.layers) == {"0.0.0", "0.0.3"}
    assert all(isinstance(model[0][0][i], FusedLinearMods) for i in (0, 3))
    assert any("fused into FusedLinearMods" in line for line in logs) and list(model.state_dict()) == keys
    assert torch.isfinite(model(torch.randn(8, 64))).all()


def test_weight_cache_counts_the_bytes_it_holds():
    """256x64 weight, rowwise e4m3: 1 byte per element and one fp32 scale per row, per cached operand."""
    cache = WeightCache()
    assert cache.nbytes == 0
    w = torch.randn(256, 64)
    cache.get(w, "scaled_mm_rowwise", "forward")
    assert cache.nbytes == 256 * 64 + 256 * 4
    cache.get(w, "scaled_mm_rowwise", "input_grad")  # W^T cast by its own rows: 64 scales
    assert cache.nbytes == 2 * 256 * 64 + 256 * 4 + 64 * 4
    cache.clear()
    assert cache.nbytes == 0


def test_loading_a_state_dict_clears_the_cached_fp8_weight():
    layer = FusedLinearMods(64, 256, mode="fused_fp8")
    layer._weight_cache.get(layer.weight, "scaled_mm_rowwise", "forward")
    assert layer._weight_cache.num_casts == 1
    layer.load_state_dict({"weight": torch.randn(256, 64)})
    assert layer._weight_cache._ops == {}  # the next FP8 GEMM re-casts the loaded weight
    layer._weight_cache.get(layer.weight, "scaled_mm_rowwise", "forward")
    assert layer._weight_cache.num_casts == 2


@pytest.mark.parametrize("on_cuda,compiling,interpreting,mode,plain", [
    (False, False, False, "split_bf16", True),   # CPU: the unfused math
    (False, False, True, "split_bf16", False),   # Triton interpreter, eager: the kernels
    (False, True, True, "fused_fp8", True),      # compiled CPU code never runs the interpreter
    (True, False, False, "split_bf16", False),   # CUDA eager: the fused kernels
    (True, True, False, "split_bf16", False),    # CUDA compiled: the kernels too (triton_ops), whatever the dtype
    (True, True, False, "fused_fp8", False),
    (True, True, False, "plain", True),          # mode plain: the PyTorch math, eager or compiled
    (True, False, False, "plain", True),
])
def test_plain_math_route(on_cuda, compiling, interpreting, mode, plain):
    from loka_trainer.mods.module import plain_math_route
    assert plain_math_route(on_cuda=on_cuda, compiling=compiling, interpreting=interpreting, mode=mode) is plain


@pytest.mark.parametrize("mode,dgrad,wgrad", [("split_fp8", "bf16", "bf16"),
                                              ("split_bf16", "scaled_mm_rowwise", "bf16"),
                                              ("fused_fp8", "bf16", "scaled_mm_tensorwise")])
def test_on_the_cpu_a_fused_layers_fp8_gemms_run_in_fp8_as_lokalinear_runs_them(mode, dgrad, wgrad):
    from loka_trainer.kernels.linear import LoKALinear
    from loka_trainer.mods.layers import BlockNorm
    torch.manual_seed(0)
    fused = FusedLinearMods(64, 256, mode=mode, dgrad=dgrad, wgrad=wgrad)
    exact = copy.deepcopy(fused)
    exact.set_kernels(mode="split_bf16", dgrad="bf16", wgrad="bf16")
    forward = "scaled_mm_rowwise" if "fp8" in mode else "bf16"
    lin = LoKALinear(64, 256, bias=False, backends={"forward": forward, "input_grad": dgrad, "weight_grad": wgrad})
    lin.weight = nn.Parameter(fused.weight.detach().clone())
    unfused = nn.Sequential(lin, BlockNorm(256, block_size=256), nn.Hardswish())
    x = torch.randn(32, 64)
    grads = []
    for layer in (fused, exact, unfused):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, 256)).sum().backward()
        grads.append((y.detach(), xi.grad, next(layer.parameters()).grad))
    for got, want in zip(grads[0], grads[2]):
        torch.testing.assert_close(got, want)  # the FP8 GEMMs LoKALinear runs, then BlockNorm and HardSwish
    planned = [forward, dgrad, wgrad]  # y, dx, dW: each planned FP8 one differs from the exact math's
    assert all(not torch.equal(f, e) for f, e, b in zip(grads[0], grads[1], planned) if b != "bf16")


@pytest.mark.parametrize("dgrad,wgrad", [("scaled_mm_rowwise", "bf16"), ("bf16", "scaled_mm_tensorwise")])
def test_plain_mode_refuses_an_fp8_backward_gemm(dgrad, wgrad):
    layer = FusedLinearMods(64, 256, mode="plain")
    with pytest.raises(ValueError, match="runs its backward GEMMs in bf16"):
        layer.set_kernels(mode="plain", dgrad=dgrad, wgrad=wgrad)
    assert (layer.mode, layer.dgrad, layer.wgrad) == ("plain", "bf16", "bf16")  # unchanged by the refusal


def test_linear_mods_op_refuses_the_plain_mode():
    from loka_trainer.mods.ops import linear_mods
    with pytest.raises(ValueError, match="not a kernel mode"):
        linear_mods(torch.randn(32, 64), torch.randn(256, 64), mode="plain")


@pytest.mark.parametrize("compiled,backends,mode", [
    (False, ("bf16", "bf16", "bf16"), "split_bf16"),
    (True, ("bf16", "bf16", "bf16"), "plain"),                   # compiled, all BF16: inductor's fused math
    (True, ("bf16", "scaled_mm_rowwise", "bf16"), "split_bf16"),  # an FP8 dgrad needs our op
    (True, ("scaled_mm_rowwise", "bf16", "bf16"), "fused_fp8"),
])
def test_a_layer_without_a_measured_mode_runs_plain_only_when_compiled_all_bf16(compiled, backends, mode):
    gemms = dict(zip(("forward", "input_grad", "weight_grad"), backends))
    assert kernels_from_plan_backends(gemms, compiled=compiled)["mode"] == mode


@pytest.mark.parametrize("compile", [False, True])
def test_mods_without_dispatch_fuse_in_the_mode_of_how_the_model_runs(compile):
    from loka_trainer.dispatch.config import LoKAConfig
    from loka_trainer.dispatch.convert import convert_to_loka
    model = _mlp()
    convert_to_loka(model, LoKAConfig(mods=True, dispatch=False, compile=compile), device="cpu", log=lambda s: None)
    modes = {m.mode for m in model.modules() if isinstance(m, FusedLinearMods)}
    assert modes == {"plain" if compile else "split_bf16"}


def test_plan_mods_mode_overrides_the_rule():
    from loka_trainer.dispatch.plan import ModsChoice
    fp8 = {"forward": "scaled_mm_rowwise", "input_grad": "bf16", "weight_grad": "bf16"}
    assert kernels_from_plan_backends(fp8, ModsChoice(mode="split_fp8"))["mode"] == "split_fp8"
    assert kernels_from_plan_backends(fp8)["mode"] == "fused_fp8"


def test_a_reused_plan_sets_each_fused_layers_forward_mode(tmp_path):
    import json

    from loka_trainer.dispatch.convert import PLAN_FILE
    cfg = dict(name="loka", mods=True, dispatch=True, timing_repeats=1, backends=["scaled_mm_rowwise"])
    apply_precision(_mlp(), config=PrecisionConfig(**cfg), device="cpu", calibration_batch=torch.randn(32, 64),
                    run_dir=tmp_path, log=lambda s: None)
    d = json.loads((tmp_path / PLAN_FILE).read_text())
    d["layers"]["0.0.0"]["forward"]["backend"] = "scaled_mm_rowwise"
    d["layers"]["0.0.0"]["mods_forward"] = {"mode": "split_fp8", "times_us": {"split_fp8": 1.0}, "speedup": 1.3}
    d["layers"]["0.0.3"]["forward"]["backend"] = "bf16"
    d["layers"]["0.0.3"]["mods_forward"] = {"mode": "fused_bf16"}
    (tmp_path / PLAN_FILE).write_text(json.dumps(d))
    model, logs = _mlp(), []
    apply_precision(model, config=PrecisionConfig(**cfg, plan=str(tmp_path / PLAN_FILE)), device="cpu",
                    log=logs.append)
    assert model[0][0][0].mode == "split_fp8" and model[0][0][3].mode == "fused_bf16"
    assert any("mods fwd    split_fp8" in line and "1.30" in line for entry in logs for line in entry.splitlines())
    # an FP8 mode where the plan's forward GEMM is BF16 (no FP8 kernel passed the accuracy test) is rejected
    d["layers"]["0.0.3"]["mods_forward"] = {"mode": "fused_fp8"}
    (tmp_path / PLAN_FILE).write_text(json.dumps(d))
    with pytest.raises(ValueError, match="FP8 mode 'fused_fp8' but the forward GEMM is bf16"):
        apply_precision(_mlp(), config=PrecisionConfig(**cfg, plan=str(tmp_path / PLAN_FILE)), device="cpu")
    d["layers"]["0.0.3"]["mods_forward"] = {"mode": "fastest"}
    (tmp_path / PLAN_FILE).write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unknown mode 'fastest'"):
        apply_precision(_mlp(), config=PrecisionConfig(**cfg, plan=str(tmp_path / PLAN_FILE)), device="cpu")


@pytest.mark.parametrize("first,second,linked", [("split_bf16", "split_fp8", True), ("split_fp8", "fused_fp8", True),
                                                 ("fused_fp8", "split_fp8", False), ("fused_bf16", "fused_fp8", False),
                                                 ("split_fp8", "split_bf16", False)])
def test_fp8_handoff_links_only_a_split_emitter_to_an_fp8_reader(first, second, linked):
    # the reader must take FP8; the emitter must run the separate epilogue kernel (the FP8 store slowed the
    # single fused GEMM+epilogue kernel by more than the reader's quantization costs, docs/kernels/README.md)
    from loka_trainer.mods.transform import chain_fp8_handoffs
    stack = nn.Sequential(FusedLinearMods(64, 256, mode=first), nn.Identity(), FusedLinearMods(256, 256, mode=second))
    assert chain_fp8_handoffs(stack) == ([("0", "2")] if linked else [])
    assert stack[0].emit_fp8 == linked and not stack[2].emit_fp8


def test_plan_mods_input_grad_overrides_the_planned_dgrad():
    from loka_trainer.dispatch.plan import ModsChoice
    planned = {"forward": "bf16", "input_grad": "bf16", "weight_grad": "bf16"}
    assert kernels_from_plan_backends(planned, None, ModsChoice(mode="scaled_mm_rowwise"))["dgrad"] == \
        "scaled_mm_rowwise"
    assert kernels_from_plan_backends({**planned, "input_grad": "scaled_mm_rowwise"}, None,
                                      ModsChoice(mode="bf16"))["dgrad"] == "bf16"


@pytest.mark.parametrize("timing", ["modes", "input_grads"])
def test_dispatch_times_a_full_step_of_the_module_per_candidate(monkeypatch, timing):
    """What Dispatch times is the FusedLinearMods the model will run (its kernels set, its weight shared), one
    whole training step per call: for the forward modes too, since each mode brings its own backward."""
    from loka_trainer.dispatch import mods_timing
    from loka_trainer.mods.module import FusedLinearMods
    calls, leaves = [], []
    original = FusedLinearMods.forward

    def spy(self, x):
        calls.append((self.mode, self.dgrad, self.wgrad))
        leaves[:] = [x, self.weight]
        return original(self, x)
    monkeypatch.setattr(FusedLinearMods, "forward", spy)

    def timer(fn):  # one call, which must be a whole step: fresh, finite gradients for x and w
        fn()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
        return 1.0
    if timing == "modes":
        a, b = ("plain", "bf16", "bf16"), ("split_bf16", "bf16", "bf16")
        times = mods_timing.time_modes(32, 64, 256, ["plain", "split_bf16"], wgrad="bf16", block=256, eps=1e-6,
                                       timer=timer, device="cpu", rounds=2)
        assert times == {"plain": [1.0, 1.0], "split_bf16": [1.0, 1.0]}
    else:
        a, b = ("split_bf16", "bf16", "bf16"), ("split_bf16", "scaled_mm_rowwise", "bf16")
        times = mods_timing.time_input_grads(32, 64, 256, ["bf16", "scaled_mm_rowwise"], mode="split_bf16",
                                             wgrad="bf16", block=256, eps=1e-6, timer=timer, device="cpu", rounds=2)
        assert times == {"bf16": [1.0, 1.0], "scaled_mm_rowwise": [1.0, 1.0]}
    assert calls == [a, b, b, a]  # interleaved


@pytest.mark.parametrize("timing", ["modes", "input_grads"])
def test_each_timed_call_pays_the_weight_cast_of_a_training_step(monkeypatch, timing):
    """A training step casts an FP8 weight once (the optimizer's step clears the cache); Dispatch's timed calls
    must too, or an eager FP8 candidate is timed without its weight cast (a graph captured on a cache hit replays
    no cast) while the compiled one, which casts inside its graph, pays it: each call clears the layer's cache
    before its forward."""
    from loka_trainer.dispatch import mods_timing
    from loka_trainer.mods.module import FusedLinearMods
    events = []
    forward, clear = FusedLinearMods.forward, FusedLinearMods.clear_weight_cache
    monkeypatch.setattr(FusedLinearMods, "forward", lambda self, x: (events.append(("forward", id(self))),
                                                                      forward(self, x))[1])
    monkeypatch.setattr(FusedLinearMods, "clear_weight_cache",
                        lambda self: (events.append(("clear", id(self))), clear(self))[1])

    def timer(fn):
        fn()
        fn()
        return 1.0
    if timing == "modes":
        mods_timing.time_modes(32, 64, 256, ["split_bf16", "split_fp8"], wgrad="bf16", block=256, eps=1e-6,
                               timer=timer, device="cpu", rounds=1)
    else:
        mods_timing.time_input_grads(32, 64, 256, ["bf16", "scaled_mm_rowwise"], mode="split_fp8", wgrad="bf16",
                                     block=256, eps=1e-6, timer=timer, device="cpu", rounds=1)
    assert len(events) == 8  # 2 candidates x 2 calls x (clear, forward)
    for (first, layer_a), (second, layer_b) in zip(events[::2], events[1::2]):
        assert (first, second) == ("clear", "forward") and layer_a == layer_b


@pytest.mark.parametrize("step_us, mere, chosen", [
    ({"bf16": 100.0, "scaled_mm_rowwise": 90.0}, 0.01, "scaled_mm_rowwise"),  # 1.11x: FP8
    ({"bf16": 100.0, "scaled_mm_rowwise": 97.0}, 0.01, "bf16"),  # 1.03x < min_speedup 1.05
    ({"bf16": 100.0, "scaled_mm_rowwise": 50.0}, 0.5, None),  # inaccurate: not offered, nothing timed
])
def test_fused_layers_input_grad_chosen_by_timing_the_layer(monkeypatch, step_us, mere, chosen):
    from loka_trainer.dispatch import build as convert
    from loka_trainer.dispatch.plan import GemmChoice, LayerPlan
    model = _mlp()
    layers = {fqn: LayerPlan(M=32, K=k, N=n, input_grad=GemmChoice(
        "bf16", candidates={"scaled_mm_rowwise": {"mere": mere, "time_us": 9.0}}))
        for fqn, (k, n) in {"0.0.0": (64, 512), "0.0.3": (512, 256)}.items()}
    timed = []
    monkeypatch.setattr(convert, "time_modes",
                        lambda M, K, N, modes, **kw: {m: (1.0 if m == "split_bf16" else 2.0) for m in modes})

    def fake_steps(M, K, N, dgrads, **kw):
        timed.append((K, N, tuple(dgrads), kw["mode"]))
        return {d: step_us[d] for d in dgrads}
    monkeypatch.setattr(convert, "time_input_grads", fake_steps)
    convert._choose_mods_modes(model, layers, timer=None, device="cpu", min_speedup=1.05, mere_threshold=0.2)
    for lp in layers.values():
        assert lp.mods_forward.mode == "split_bf16"
        assert (lp.mods_input_grad is None) if chosen is None else (lp.mods_input_grad.mode == chosen)
    assert timed == ([] if chosen is None else [(64, 512, ("bf16", "scaled_mm_rowwise"), "split_bf16"),
                                                (512, 256, ("bf16", "scaled_mm_rowwise"), "split_bf16")])


@pytest.mark.parametrize("compiled,plain_us,chosen", [
    (False, 0.5, "split_bf16"),  # eager: plain is not a candidate, whatever it would take
    (True, 0.5, "plain"),        # compiled: the plain Mods compete and win here
    (True, 1.5, "split_bf16"),
])
def test_compiled_dispatch_times_the_plain_mods_on_all_bf16_layers_only(monkeypatch, compiled, plain_us, chosen):
    from loka_trainer.dispatch import build
    from loka_trainer.dispatch.plan import GemmChoice, LayerPlan
    fp8 = "scaled_mm_rowwise"
    layers = {"0.0.0": LayerPlan(M=32, K=64, N=512, input_grad=GemmChoice(
                  "bf16", candidates={fp8: {"mere": 0.01, "time_us": 9.0}})),  # all BF16, an accurate FP8 dgrad
              "0.0.3": LayerPlan(M=32, K=512, N=256, input_grad=GemmChoice(fp8))}  # an FP8 dgrad planned
    offered, dgrad_timed = {}, []
    times = {"plain": plain_us, "split_bf16": 1.0}

    def fake_modes(M, K, N, modes, **kw):
        assert kw["compiled"] is compiled
        offered[(K, N)] = tuple(modes)
        return {m: times.get(m, 2.0) for m in modes}

    def fake_steps(M, K, N, dgrads, **kw):
        dgrad_timed.append((K, kw["mode"]))
        return {d: 1.0 for d in dgrads}
    monkeypatch.setattr(build, "time_modes", fake_modes)
    monkeypatch.setattr(build, "time_input_grads", fake_steps)
    build._choose_mods_modes(_mlp(), layers, timer=None, device="cpu", min_speedup=1.05, mere_threshold=0.2,
                             compiled=compiled)
    assert ("plain" in offered[(64, 512)]) is compiled and "plain" not in offered[(512, 256)]
    assert layers["0.0.0"].mods_forward.mode == chosen and layers["0.0.3"].mods_forward.mode == "split_bf16"
    # the plain Mods have no FP8 backward: no input-grad timing for a layer that chose them
    assert [k for k, _ in dgrad_timed] == ([512] if chosen == "plain" else [64, 512])


@pytest.mark.parametrize("dgrad,wgrad,ok", [("bf16", "bf16", True), ("scaled_mm_rowwise", "bf16", False),
                                            ("bf16", "scaled_mm_rowwise", False)])
def test_a_plan_with_plain_mods_and_an_fp8_backward_is_rejected(dgrad, wgrad, ok):
    from loka_trainer.dispatch.plan import DispatchPlan, GemmChoice, LayerPlan, ModsChoice, validate_plan
    from loka_trainer.mods.modes import FORWARD_MODES
    lp = LayerPlan(M=32, K=64, N=512, input_grad=GemmChoice(dgrad), weight_grad=GemmChoice(wgrad),
                   mods_forward=ModsChoice("plain"))
    plan = DispatchPlan(device="cpu", layers={"0.0.0": lp})

    def check():
        validate_plan(plan, {"0.0.0": (64, 512)}, ["bf16", "scaled_mm_rowwise"],
                      mods_modes={m: f.fp8 for m, f in FORWARD_MODES.items()})
    if ok:
        check()
    else:
        with pytest.raises(ValueError, match="mode 'plain' runs bf16 backward GEMMs"):
            check()


def test_mods_triples_the_kernels_cannot_run_are_named_with_the_reason():
    from loka_trainer.dispatch.convert import fuse_with_plan
    from loka_trainer.dispatch.plan import DispatchPlan
    model = nn.Sequential(nn.Sequential(mlp(64, [512, 192], bias=False, norm="blocknorm", activation="hardswish",
                                            block_size=256)), nn.Linear(192, 1))
    logs = []
    assert fuse_with_plan(model, DispatchPlan(device="cpu", layers={}), module_filter_fn=None,
                          log=logs.append) == ["0.0.0"]
    assert logs[-1].endswith("1 stay unfused, as the kernels need: 0.0.3 (N=192 is not a multiple of the block 256)")


@pytest.mark.parametrize("block_size", [256.0, 0, True])
def test_apply_mods_refuses_a_block_size_that_is_not_a_positive_integer(block_size):
    from loka_trainer.mods.transform import apply_mods
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.SiLU())
    with pytest.raises(ValueError, match=r"apply_mods: block_size must be an integer >= 1"):
        apply_mods(model, block_size=block_size)
    assert isinstance(model[1], nn.LayerNorm)
