"""Fused forward: per-config kernel time by graph replay vs the eager autotuner's pick, small figure-13 shapes (r26a).

    python docs/kernels/r26a_diag/diag_fwd_configs.py OUT.json   (CUDA; prints one line per shape, dtype)
"""
import json, sys
import torch
from loka_trainer.kernels import triton_mods
from loka_trainer.kernels.dispatch import cuda_graph_us
from loka_trainer.kernels.triton_mods_kernels import configs
from loka_trainer.kernels.quant import quantize_rowwise
from loka_trainer.kernels.mods_ops import linear_mods

out = []
for K, N in [(256, 256), (512, 512), (256, 7680), (7680, 256)]:
    torch.manual_seed(0)
    x = torch.randn(1024, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    for fp8 in (False, True):
        if fp8:
            (xa, sx), (wa, sw) = (quantize_rowwise(t, torch.float8_e4m3fn) for t in (x, w))
            kw = dict(x_scale_inv=sx, w_scale_inv=sw)
        else:
            xa, wa, kw = x, w, {}
        auto = cuda_graph_us(lambda: triton_mods.fused_forward(xa, wa, **kw))
        pick = [p["config"] for p in triton_mods.autotune_picks() if p["key"]["K"] == K and p["key"]["N"] == N
                and p["key"]["HAS_SCALES"] == fp8 and p["key"]["SAVE_FOR_BACKWARD"]]
        row = {"K": K, "N": N, "fp8": fp8, "autotuned_us": auto, "pick": pick, "configs": []}
        for c in configs:
            cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
            try:
                t = cuda_graph_us(lambda: triton_mods.fused_forward(xa, wa, config=cfg, **kw))
            except Exception as e:
                t = None
            row["configs"].append({"config": cfg, "us": t})
        best = min((c for c in row["configs"] if c["us"]), key=lambda c: c["us"])
        # the layer step (fwd+bwd) with the mode that uses the fused forward
        xr = x.clone().requires_grad_()
        wr = w.clone().requires_grad_()
        dy = torch.randn(1024, N, device="cuda", dtype=torch.bfloat16)
        mode = "fused_fp8" if fp8 else "fused_bf16"
        row["step_us"] = cuda_graph_us(lambda: linear_mods(xr, wr, mode=mode).backward(dy), grad_to_none=[xr, wr])
        out.append(row)
        print(f"({K},{N}) fp8={fp8} autotuned {auto:.2f} us pick {pick} | best {best['us']:.2f} {best['config']} | "
              f"step {row['step_us']:.1f}", flush=True)
        print("    " + " ".join(f"{c['us']:.2f}" if c['us'] else "x" for c in row["configs"]), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
