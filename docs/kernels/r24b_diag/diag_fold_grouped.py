"""The r24b diagnostics of docs/kernels/README.md (thirteenth round), as run on the H200 at commit 9fa9e6e:
(1) the grouped backward-GEMM kernel as refactored (one ``_gemm_tile``) vs as first timed in r23 (commit 7ae7294's
kernel file, read from git history), each autotune config and the layer step;
(2) the folded weight grad's pieces at the four large figure-13 shapes.

Run from the repository root of a git checkout: ``python docs/kernels/r24b_diag/diag_fold_grouped.py OUT`` (writes
OUT/diag_r24.json). A one-off diagnostic: the timing API it calls (``wgrad_fold.fold_operands`` and its tile
globals) is that of 9fa9e6e.
"""
import importlib.util, json, os, subprocess, sys, tempfile
sys.path.insert(0, ".")
import torch
from loka_trainer.kernels import triton_grads, wgrad_fold
from loka_trainer.kernels import triton_grads_kernels as new_k
from loka_trainer.kernels.mods_ops import linear_mods
from loka_trainer.kernels.quant import quantize_rowwise


def _old_grads_kernels():
    """The kernel module as timed in r23 (commit 7ae7294), imported from a temporary copy."""
    source = subprocess.run(["git", "show", "7ae7294:loka_trainer/kernels/triton_grads_kernels.py"],
                            check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "old_grads_kernels.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_grads_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


old_k = _old_grads_kernels()
out = sys.argv[1]
from loka_trainer.kernels.dispatch import cuda_graph_us
def us(fn, grads=None):
    try:
        return round(cuda_graph_us(fn, rep_ms=40, grad_to_none=grads), 2)
    except Exception as e:
        print("capture failed", str(e)[:200]); return None
res = {"grouped": [], "fold": []}
for K, N in [(256, 256), (512, 512)]:
    M = 1024
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda") / K ** .5).bfloat16().requires_grad_()
    dy = torch.randn(M, N, device="cuda").bfloat16()
    dz = torch.randn(M, N, device="cuda").bfloat16()
    row = {"K": K, "N": N}
    for name, mod in (("new", new_k), ("old", old_k)):
        for i, cfg in enumerate(mod.configs):
            c = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            triton_grads._kernel.cache_clear()
            orig = triton_grads._kernel
            triton_grads._kernel = lambda mod=mod: mod.grads_kernel
            row[f"{name}_cfg{i}"] = us(lambda: triton_grads.grads(dz, x.detach(), w.detach(), config=c))
            triton_grads._kernel = orig
    for name, mod in (("new", new_k), ("old", old_k)):
        triton_grads._kernel = lambda mod=mod: mod.grads_kernel
        for mode in ("split_bf16", "fused_bf16"):
            row[f"{name}_{mode}_step"] = us(lambda: linear_mods(x, w, mode=mode).backward(dy), [x, w])
        row[f"{name}_autotuned_grads"] = us(lambda: triton_grads.grads(dz, x.detach(), w.detach()))
        row[f"{name}_pick"] = str(mod.grads_kernel.best_config)
    triton_grads._kernel = orig
    res["grouped"].append(row); print(row, flush=True)
for K, N in [(4096, 2048), (4096, 2560), (2048, 4096), (2560, 4096)]:
    M = 1024
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    dz = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    xq, sx = quantize_rowwise(x, torch.float8_e4m3fn)
    dzt, s, xqt = wgrad_fold.fold_operands(dz, xq, sx)
    one = wgrad_fold.unit_scale(x.device)
    row = {"K": K, "N": N,
           "wgrad_bf16": us(lambda: dz.t() @ x),
           "wgrad_tw_gemm_only": us(lambda: torch._scaled_mm(dzt, xqt.t(), scale_a=s, scale_b=one, out_dtype=torch.bfloat16)),
           "fold_operands": us(lambda: wgrad_fold.fold_operands(dz, xq, sx)),
           "wgrad_fold_total": us(lambda: wgrad_fold.wgrad_fold(dz, xq, sx)),
           "torch_xq_transpose": us(lambda: xq.t().contiguous()),
           "torch_dz_transpose": us(lambda: dz.t().contiguous())}
    for bm, bc in [(32, 32), (64, 128), (128, 64), (128, 128)]:
        wgrad_fold.BLOCK_R, wgrad_fold.BLOCK_C = bm, bc
        row[f"fold_operands_{bm}x{bc}"] = us(lambda: wgrad_fold.fold_operands(dz, xq, sx))
    wgrad_fold.BLOCK_R, wgrad_fold.BLOCK_C = 64, 64
    res["fold"].append(row); print(row, flush=True)
json.dump(res, open(os.path.join(out, "diag_r24.json"), "w"), indent=1)
