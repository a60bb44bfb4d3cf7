"""r28 (reverted): the fused forward without u and r + a dz kernel recomputing z (mode *_recompute) vs the fused modes: kernels and layer steps at the figure-13 shapes, graph replay. Usage: OUT=dir python scripts/bench_recompute_dz_gpu.py"""
import json, os, sys, math
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from loka_trainer.kernels import triton_mods
from loka_trainer.kernels.quant import quantize
from loka_trainer.kernels.dispatch import cuda_graph_us
from loka_trainer.kernels.mods_ops import linear_mods
from loka_trainer.kernels.linear import WeightCache
from fig13_variants import FIG13_SHAPES
out = os.environ.get("OUT", "/tmp")
rows = []
M = 1024
t = lambda f: cuda_graph_us(f, rep_ms=50)
for K, N in FIG13_SHAPES:
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    xq, sx = quantize(x, "rowwise", torch.float8_e4m3fn); wq, sw = quantize(w, "rowwise", torch.float8_e4m3fn)
    row = {"K": K, "N": N}
    for tag, a, b, kw in [("bf16", x, w, {}), ("fp8", xq, wq, dict(x_scale_inv=sx, w_scale_inv=sw))]:
        h, u, r, _ = triton_mods.fused_forward(a, b, **kw)
        dz_u = triton_mods.backward_dz(dy, u, r)
        dz_rc = triton_mods.backward_dz_recompute(dy, a, b, **kw)
        row[f"{tag}_maxdiff"] = float((dz_u.float() - dz_rc.float()).abs().max())
        row[f"{tag}_rel"] = float((dz_u.float() - dz_rc.float()).norm() / dz_u.float().norm())
        row[f"{tag}_fwd_save"] = t(lambda: triton_mods.fused_forward(a, b, **kw))
        row[f"{tag}_fwd_nosave"] = t(lambda: triton_mods.fused_forward(a, b, save=False, **kw))
        row[f"{tag}_dz_u"] = t(lambda: triton_mods.backward_dz(dy, u, r))
        row[f"{tag}_dz_rc"] = t(lambda: triton_mods.backward_dz_recompute(dy, a, b, **kw))
    xl = x.clone().requires_grad_(); wl = w.clone().requires_grad_()
    for mode in ["fused_bf16", "fused_bf16_recompute", "fused_fp8", "fused_fp8_recompute", "split_bf16"]:
        cache = WeightCache()
        def step(mode=mode, cache=cache):
            xl.grad = wl.grad = None
            linear_mods(xl, wl, mode=mode, cache=cache).backward(dy)
        try:
            row[f"step_{mode}"] = t(step)
        except Exception as e:
            row[f"step_{mode}"] = None; row[f"err_{mode}"] = str(e)[:300]
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(out, "rc_micro.json"), "w"), indent=1)
print("\n(K,N) | bf16 fwd save/nosave dz u/rc | fp8 fwd save/nosave dz u/rc | steps fb fbR f8 f8R split")
for r in rows:
    print(f"({r['K']},{r['N']}) | {r['bf16_fwd_save']:.1f}/{r['bf16_fwd_nosave']:.1f} {r['bf16_dz_u']:.1f}/{r['bf16_dz_rc']:.1f} "
          f"| {r['fp8_fwd_save']:.1f}/{r['fp8_fwd_nosave']:.1f} {r['fp8_dz_u']:.1f}/{r['fp8_dz_rc']:.1f} | "
          + " ".join(f"{r.get('step_'+m) or float('nan'):.1f}" for m in ["fused_bf16", "fused_bf16_recompute", "fused_fp8", "fused_fp8_recompute", "split_bf16"])
          + f" | rel {r['bf16_rel']:.2e} {r['fp8_rel']:.2e}")
