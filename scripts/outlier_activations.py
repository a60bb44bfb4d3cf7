"""What the FP8-eligible Linears of a model see, with and without ``data.outliers``: input amax, amax / RMS and
the relative error of casting the input to e4m3 with one scale per tensor vs one per row.

    python -m scripts.outlier_activations --out docs/results/outliers_cpu/activations.json --model wukong \
        -- data.num_dense=16 data.outliers.spike_rate=0.001 data.outliers.hot_features=2

The model is at initialisation (seed 0) under the published Mods; the first Linear's input is the data itself, so
its numbers hold for any training step. The data overrides apply to the "on" side; "off" is the same with
``data.outliers`` at its defaults.
"""
from __future__ import annotations

import argparse
import json

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from loka_trainer.arg_types import positive_int, writable_file
from loka_trainer.data.config import DataConfig, OutlierConfig
from loka_trainer.data.schema import data_schema
from loka_trainer.data.synthetic import SyntheticSource
from loka_trainer.dispatch.targets import target_linears
from loka_trainer.models.configs import preset_config
from loka_trainer.models.zoo import build_model

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def e4m3_relative_error(x: torch.Tensor, rowwise: bool) -> tuple[float, float]:
    """x: (N, K) -> (||x - q(x)|| / ||x||, fraction of nonzero values that cast to 0) for e4m3 with amax scaling."""
    amax = x.abs().amax(dim=1, keepdim=True) if rowwise else x.abs().amax()
    scale = E4M3_MAX / amax.clamp_min(1e-12)
    q = (x * scale).to(torch.float8_e4m3fn).float() / scale
    nonzero = x != 0
    flushed = float(((q == 0) & nonzero).sum() / nonzero.sum().clamp_min(1))
    return float((x - q).norm() / x.norm().clamp_min(1e-30)), flushed


def linear_input_stats(model: torch.nn.Module, batches: list, min_features: int) -> dict[str, dict]:
    linears = target_linears(model, min_features=min_features)
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    hooks = [mod.register_forward_pre_hook(lambda m, a, name=name: inputs[name].append(a[0].detach().flatten(0, -2)))
             for name, mod in linears.items()]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for h in hooks:
        h.remove()
    out = {}
    for name, xs in inputs.items():
        x = torch.cat(xs).float()
        rms = float(x.pow(2).mean().sqrt())
        channel_rms = x.pow(2).mean(0).sqrt()
        tensor_err, tensor_flush = e4m3_relative_error(x, rowwise=False)
        row_err, row_flush = e4m3_relative_error(x, rowwise=True)
        out[name] = {"shape_k": x.shape[1], "amax": float(x.abs().max()), "rms": rms,
                     "amax_over_rms": float(x.abs().max()) / max(rms, 1e-30),
                     "max_channel_rms_over_median": float(channel_rms.max() / channel_rms.median().clamp_min(1e-30)),
                     "e4m3_rel_err_tensorwise": tensor_err, "e4m3_flushed_tensorwise": tensor_flush,
                     "e4m3_rel_err_rowwise": row_err, "e4m3_flushed_rowwise": row_flush}
    return out


def data_config(overrides: list[str]) -> DataConfig:
    schema = OmegaConf.structured(DataConfig)
    cfg = OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.from_dotlist([o.removeprefix("data.")
                                                                              for o in overrides])))
    cfg.validate()
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=writable_file, required=True)
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--batches", type=positive_int, default=4)
    ap.add_argument("--min-features", type=positive_int, default=16)
    ap.add_argument("overrides", nargs="*", help="data.* overrides of the outlier side (after --)")
    args = ap.parse_args()
    try:  # a bad preset or override: argparse's one line, before any model is built
        on = data_config(args.overrides)
        model_cfg = preset_config(args.model)
    except (ValueError, OmegaConfBaseException) as exc:
        ap.error(" ".join(str(exc).split()))
    off = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(on), {"outliers": OutlierConfig()}))
    result = {"command": "python -m scripts.outlier_activations " + " ".join(
        [f"--out {args.out}", f"--model {args.model}", "--", *args.overrides]), "sides": {}}
    for side, cfg in (("off", off), ("on", on)):
        torch.manual_seed(0)
        model = build_model(model_cfg, schema=data_schema(cfg), loka_mods=False).eval()
        source = SyntheticSource(cfg)
        batches = [source.batch_at("eval", i) for i in range(args.batches)]
        result["sides"][side] = linear_input_stats(model, batches, args.min_features)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'layer':32s} {'side':4s} {'amax':>10s} {'amax/rms':>9s} {'ch max/med':>10s} {'err tw':>8s} "
          f"{'flush tw':>8s} {'err rw':>8s}")
    for name in result["sides"]["on"]:
        for side in ("off", "on"):
            s = result["sides"][side][name]
            print(f"{name:32s} {side:4s} {s['amax']:10.3g} {s['amax_over_rms']:9.3g} "
                  f"{s['max_channel_rms_over_median']:10.3g} {s['e4m3_rel_err_tensorwise']:8.4f} "
                  f"{s['e4m3_flushed_tensorwise']:8.4f} {s['e4m3_rel_err_rowwise']:8.4f}")


if __name__ == "__main__":
    main()
