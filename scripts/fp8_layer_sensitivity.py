"""How much one Linear's FP8 forward moves the model's output: each Dispatch target in turn runs its forward GEMM
in FP8 (``LoKALinear``, a real ``_scaled_mm`` kernel), every other layer BF16, on the same held-out batches.

    python -m scripts.fp8_layer_sensitivity --out docs/results/interformer_sensitivity_cpu/sensitivity.json \
        --model interformer_h200 --batch 64 -- model.embedding_dim=16

Per layer: the GEMM's own output error (relative 2-norm, what a per-GEMM error such as MERE sees) and the model's
logit change (relative 2-norm of the change over the spread of the BF16 logits) and log-loss change. A layer
whose logit change is large for its own output error feeds something that amplifies it. The model is at
initialisation (``--seed``) with the LoKA Mods, unfused; the overrides are ``model.*`` / ``data.*`` keys.
Why by hand: no library scores a per-layer kernel swap by its effect on the model's output.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loka_trainer.arg_types import positive_int, writable_file
from loka_trainer.data.config import DataConfig
from loka_trainer.data.schema import data_schema
from loka_trainer.data.synthetic import SyntheticSource
from loka_trainer.dispatch.targets import target_linears
from loka_trainer.kernels.backends import BACKENDS
from loka_trainer.kernels.linear import LoKALinear
from loka_trainer.models.configs import preset_config
from loka_trainer.models.zoo import build_model
from scripts.outlier_activations import data_config as outlier_data_config
from scripts.plot_results import pyplot


def relative_change(new: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> float:
    """||new - ref|| / ||scale||, both flattened to float32."""
    return float((new.float() - ref.float()).norm() / scale.float().norm().clamp_min(1e-30))


def swap(model: torch.nn.Module, fqn: str, new: torch.nn.Module) -> None:
    """Put ``new`` at ``fqn`` in ``model``."""
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def outputs(model, batches, capture) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One pass over ``batches`` under BF16 autocast: (the logits, concatenated (B·n,), {fqn: that module's output,
    rows concatenated (rows, N)} for each FQN in ``capture``), float32."""
    outs: dict[str, list[torch.Tensor]] = {fqn: [] for fqn in capture}
    handles = [model.get_submodule(fqn).register_forward_hook(
        lambda m, a, out, fqn=fqn: outs[fqn].append(out.detach().float().flatten(0, -2))) for fqn in capture]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = torch.cat([model(b).float() for b in batches])
    finally:
        for handle in handles:
            handle.remove()
    return logits, {fqn: torch.cat(parts) for fqn, parts in outs.items()}


def forward(model, batches) -> torch.Tensor:
    """Logits of every batch, concatenated (B·n,) float32, under BF16 autocast."""
    return outputs(model, batches, ())[0]


def sensitivity(model, batches, labels: torch.Tensor, linears: dict[str, torch.nn.Linear], backend: str) -> dict:
    """{fqn: {gemm_rel_err, logit_rel_change, logloss_rel_change}} for ``backend`` on each layer's forward alone."""
    ref, ref_outs = outputs(model, batches, list(linears))
    ref_loss = float(F.binary_cross_entropy_with_logits(ref, labels))
    spread = ref - ref.mean()
    out = {}
    for fqn, linear in linears.items():
        swap(model, fqn, LoKALinear.from_linear(linear, {"forward": backend, "input_grad": "bf16",
                                                         "weight_grad": "bf16"}))
        logits, fp8_outs = outputs(model, batches, [fqn])
        swap(model, fqn, linear)
        loss = float(F.binary_cross_entropy_with_logits(logits, labels))
        out[fqn] = {"shape": [linear.in_features, linear.out_features],
                    "gemm_rel_err": relative_change(fp8_outs[fqn], ref_outs[fqn], ref_outs[fqn]),
                    "logit_rel_change": relative_change(logits, ref, spread),
                    "logloss_rel_change": (loss - ref_loss) / ref_loss}
    return {"ref_logloss": ref_loss, "layers": out}


def plot(result: dict, path: Path, mark: list[str]) -> Path:
    """Bars of each layer's logit change and GEMM error, largest logit change first; layers matching a ``mark``
    glob in red."""
    plt = pyplot()
    rows = sorted(result["layers"].items(), key=lambda kv: kv[1]["logit_rel_change"])
    fig, ax = plt.subplots(figsize=(8, 0.16 * len(rows) + 1.2))
    y = range(len(rows))
    colors = ["tab:red" if any(fnmatch.fnmatchcase(f, m) for m in mark) else "tab:blue" for f, _ in rows]
    ax.barh(y, [r["logit_rel_change"] for _, r in rows], color=colors, label="logit change (relative)")
    ax.plot([r["gemm_rel_err"] for _, r in rows], y, "k|", label="the GEMM's own output error")
    ax.set_yticks(list(y), [f for f, _ in rows], fontsize=6)
    ax.set_xlabel("relative change, one layer's forward in FP8")
    ax.legend(fontsize=7, loc="lower right")
    fig.subplots_adjust(left=0.38, right=0.97, top=0.99, bottom=0.8 / (0.16 * len(rows) + 1.2))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def data_config(overrides: list[str], batch: int, num_sequences: int) -> DataConfig:
    """The synthetic data of the ``data.*`` overrides (``outlier_activations.data_config``), at ``batch`` rows,
    with the model's behaviour sequences."""
    cfg = dataclasses.replace(outlier_data_config([o for o in overrides if o.startswith("data.")]),
                              batch_size=batch, num_sequences=num_sequences)
    cfg.validate()
    return cfg


def unaligned_batch(batch: int, backend: str) -> Optional[str]:
    """Why ``batch`` cannot measure ``backend``, or None. The zoo models' Linears see M = batch x (rows per
    example) input rows, the dense and MLP layers one row per example, and an FP8 backend runs a GEMM only when M
    is a multiple of its ``min_multiple``: at any other batch those layers fall back to BF16 and report 0 error."""
    multiple = BACKENDS[backend].min_multiple
    if batch % multiple == 0:
        return None
    return (f"--batch {batch}: --backend {backend} runs a GEMM in FP8 only when its input rows (batch x rows per "
            f"example) are a multiple of {multiple}; at this batch the per-example layers would fall back to BF16 "
            f"and report 0 error; use a multiple of {multiple}, e.g. {-(-batch // multiple) * multiple}")


def parse_args(argv: Optional[list[str]] = None) -> tuple[argparse.Namespace, Any, DataConfig]:
    """(the command line, the model config, the data config); a bad value, preset or override, or a batch the
    backend cannot run in FP8, is argparse's error before any model is built."""
    ap = argparse.ArgumentParser(prog="python -m scripts.fp8_layer_sensitivity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_file, required=True)
    ap.add_argument("--model", default="interformer_h200", help="a conf/model preset")
    ap.add_argument("--batch", type=positive_int, default=64, help="a multiple of 16 (of 128 for 128-tile backends)")
    ap.add_argument("--batches", type=positive_int, default=4)
    ap.add_argument("--backend", default="scaled_mm_rowwise", choices=sorted(BACKENDS))
    ap.add_argument("--min-features", type=positive_int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mark", nargs="*", default=[], help="layer globs drawn in red in the plot")
    ap.add_argument("overrides", nargs="*", help="model.* / data.* overrides (after --)")
    args = ap.parse_args(argv)
    if (reason := unaligned_batch(args.batch, args.backend)) is not None:
        ap.error(reason)
    try:  # a bad preset or override: argparse's one line, before any model is built
        model_cfg = OmegaConf.to_object(OmegaConf.merge(
            OmegaConf.structured(preset_config(args.model)),
            OmegaConf.from_dotlist([o.removeprefix("model.") for o in args.overrides if o.startswith("model.")])))
        data_cfg = data_config(args.overrides, args.batch, getattr(model_cfg, "num_sequences", 0))
    except (ValueError, OmegaConfBaseException) as exc:
        ap.error(" ".join(str(exc).split()))
    return args, model_cfg, data_cfg


def main(argv: Optional[list[str]] = None) -> None:
    args, model_cfg, data_cfg = parse_args(argv)
    torch.manual_seed(args.seed)
    model = build_model(model_cfg, schema=data_schema(data_cfg), loka_mods=True).eval()
    source = SyntheticSource(data_cfg)
    batches = [source.batch_at("eval", i) for i in range(args.batches)]
    labels = torch.cat([b.labels.float() for b in batches])
    result = sensitivity(model, batches, labels, target_linears(model, min_features=args.min_features), args.backend)
    result.update(command="python -m scripts.fp8_layer_sensitivity " + " ".join(
        [f"--out {args.out}", f"--model {args.model}", f"--batch {args.batch}", f"--batches {args.batches}",
         f"--backend {args.backend}", f"--seed {args.seed}", *(["--mark", *args.mark] if args.mark else []), "--",
         *args.overrides]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}, {plot(result, args.out.with_suffix('.png'), args.mark)}")
    rows = sorted(result["layers"].items(), key=lambda kv: -kv[1]["logit_rel_change"])
    print(f"{'layer':48s} {'K x N':>12s} {'GEMM err':>9s} {'logit chg':>10s} {'ratio':>7s} {'logloss chg':>12s}")
    for fqn, r in rows:
        print(f"{fqn:48s} {r['shape'][0]:>5d} x {r['shape'][1]:<5d} {r['gemm_rel_err']:9.4f} "
              f"{r['logit_rel_change']:10.5f} {r['logit_rel_change'] / max(r['gemm_rel_err'], 1e-12):7.3f} "
              f"{r['logloss_rel_change']:+12.2e}")


if __name__ == "__main__":
    main()
