"""r28 (reverted): the recomputing dz kernel against every fused-forward config at three short-K shapes. Usage: OUT=dir python scripts/bench_recompute_dz_configs_gpu.py"""
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from loka_trainer.kernels import triton_mods
from loka_trainer.kernels.quant import quantize
from loka_trainer.kernels.dispatch import cuda_graph_us
from loka_trainer.kernels.triton_mods_kernels import configs
t = lambda f: cuda_graph_us(f, rep_ms=50)
M = 1024; rows = []
for K, N in [(256, 7680), (256, 256), (512, 512)]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    xq, sx = quantize(x, "rowwise", torch.float8_e4m3fn); wq, sw = quantize(w, "rowwise", torch.float8_e4m3fn)
    for tag, a, b, kw in [("bf16", x, w, {}), ("fp8", xq, wq, dict(x_scale_inv=sx, w_scale_inv=sw))]:
        h, u, r, _ = triton_mods.fused_forward(a, b, **kw)
        row = dict(K=K, N=N, tag=tag, fwd_save=t(lambda: triton_mods.fused_forward(a, b, **kw)),
                   fwd_nosave=t(lambda: triton_mods.fused_forward(a, b, save=False, **kw)),
                   dz_u=t(lambda: triton_mods.backward_dz(dy, u, r)),
                   dz_rc=t(lambda: triton_mods.backward_dz_recompute(dy, a, b, **kw)))
        cfg = {}
        for c in configs:
            conf = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
            try:
                cfg[str(tuple(conf.values()))] = t(lambda: triton_mods.backward_dz_recompute(dy, a, b, config=conf, **kw))
            except Exception as e:
                cfg[str(tuple(conf.values()))] = str(e)[:80]
        row["dz_rc_configs"] = cfg
        rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "rc_micro2.json"), "w"), indent=1)
for r in rows:
    best = min((v, k) for k, v in r["dz_rc_configs"].items() if isinstance(v, float))
    print(f"({r['K']},{r['N']}) {r['tag']}: fwd save {r['fwd_save']:.1f} nosave {r['fwd_nosave']:.1f} | dz_u {r['dz_u']:.1f} dz_rc {r['dz_rc']:.1f} best cfg {best[0]:.1f} {best[1]}")
