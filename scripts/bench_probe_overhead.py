"""Step-time overhead of the LoKA Probe at interval 100 vs no probe, measured side by side in one run.

    .venv/bin/python scripts/bench_probe_overhead.py [--model wukong] [--rounds 6] [--interval 100]
        [--device cpu|cuda] [--out runs/bench_probe_overhead] [hydra overrides, e.g. data.batch_size=4096]

Model: ``loka_trainer.models.zoo.build_model`` from the Hydra config (``model=wukong`` by default, single
process, no sharding: the probe's cost is per-rank work plus one collective merge per save, so one process
shows the per-step part). If the zoo or the config cannot be imported, a plain MLP stack of Wukong-like
widths is used instead and the output says so.

Method: blocks of ``interval`` training steps alternate between "off" (no callback at all) and "probe" (the
callback driven as the trainer does, observing the first step of each block, i.e. exactly interval 100),
for ``rounds`` rounds after a warm-up block of each; the ratio is median(probe block) / median(off block).
Because a shared machine's load drifts between blocks, a second, paired estimate is printed too: each
observed step's time minus the median of its 10 neighbouring (unobserved) steps, spread over the interval:
overhead = mean(extra per observed step) / (interval * median step).
Saving is timed separately (the non-blocking part a step pays: the collective merge + device clone).
Target from the paper: <= 1% overhead. Timings on this CPU machine say nothing about GPU numbers.
Writes ``<out>/probe_overhead.json`` and ``probe_overhead.png``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from itertools import cycle
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loka_trainer.callbacks.base import TrainState  # noqa: E402
from loka_trainer.callbacks.probe import ProbeCallback  # noqa: E402


class _MLPStack(nn.Module):
    """Fallback: Wukong-like widths without embeddings. batch: (B, 13) dense features -> logits (B,)."""

    def __init__(self, widths=(13, 512, 512, 512, 512, 1)):
        super().__init__()
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, batch):
        return self.net(batch.dense).squeeze(-1)


def build(model_name: str, overrides: list[str], device: torch.device):
    """(model, list of batches, description). Zoo model from Hydra config, else the MLP fallback."""
    try:
        from hydra import compose, initialize_config_dir

        from loka_trainer.config import register_schemas, to_run_config
        from loka_trainer.data import build_stream, data_schema
        from loka_trainer.models.zoo import build_model

        register_schemas()
        conf_dir = str(Path(__file__).resolve().parents[1] / "conf")
        with initialize_config_dir(config_dir=conf_dir, version_base=None):
            cfg = compose("config", overrides=[f"model={model_name}", *overrides])
        run = to_run_config(cfg)
        model = build_model(run.model, schema=data_schema(run.data), loka_mods=False)
        stream = iter(build_stream(run.data, split="train", rank=0, world_size=1))
        batches = [next(stream).to(device) for _ in range(8)]
        return model.to(device), batches, f"zoo:{model_name} batch {len(batches[0])}"
    except Exception as exc:  # noqa: BLE001 - the benchmark must still say something useful
        print(f"NOTE: zoo model unavailable ({type(exc).__name__}: {exc}); using an MLP stack of Wukong-like widths")
        from types import SimpleNamespace

        batches = [SimpleNamespace(dense=torch.randn(4096, 13, device=device),
                                   labels=torch.randint(0, 2, (4096,), device=device).float()) for _ in range(8)]
        return _MLPStack().to(device), batches, "fallback:mlp_stack batch 4096"


def run_block(model, opt, batches, *, num_steps: int, probe=None, state=None, first_step: int = 0,
              step_times: list | None = None) -> float:
    """Seconds for num_steps training steps; the probe (if any) is driven like the trainer drives it."""
    sync = torch.cuda.synchronize if next(model.parameters()).is_cuda else (lambda: None)
    sync()
    start = last = time.perf_counter()
    for i in range(num_steps):
        if step_times is not None:  # per-step times need a sync per step; only the paired estimate uses them
            sync()
            now = time.perf_counter()
            if i:
                step_times.append(now - last)
            last = now
        batch = next(batches)
        if probe is not None:
            state.step = first_step + i
            probe.on_step_start(state)
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if probe is not None:
            probe.on_step_end(state)
    sync()
    if step_times is not None:
        step_times.append(time.perf_counter() - last)
    return time.perf_counter() - start


def paired_overhead(step_times: list[float], interval: int) -> tuple[float, float]:
    """(extra seconds per observed step, overhead fraction) from per-step times; step 0 of each block observed."""
    extras, normal = [], []
    for i, t in enumerate(step_times):
        if i % interval == 0:
            neighbours = [step_times[j] for j in range(max(0, i - 5), min(len(step_times), i + 6)) if j % interval]
            extras.append(t - statistics.median(neighbours))
        else:
            normal.append(t)
    extra = statistics.mean(extras)
    return extra, extra / (interval * statistics.median(normal))


def measure(args) -> dict:
    device = torch.device(args.device)
    model, batch_list, description = build(args.model, args.overrides, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = cycle(batch_list)
    out_dir = Path(tempfile.mkdtemp(prefix="probe_bench_"))
    probe = ProbeCallback(interval=args.interval, save_interval=10**12, out_dir=str(out_dir), tensorboard=False)
    state = TrainState(model=model, device=device)
    probe.on_train_start(state)
    run_block(model, opt, batches, num_steps=args.interval)  # warm-up, both paths
    run_block(model, opt, batches, num_steps=args.interval, probe=probe, state=state)
    off, on = [], []
    for r in tqdm(range(args.rounds), desc="rounds", unit="round"):
        off.append(run_block(model, opt, batches, num_steps=args.interval))
        on.append(run_block(model, opt, batches, num_steps=args.interval, probe=probe, state=state,
                            first_step=(r + 1) * args.interval))
    step_times: list[float] = []
    first = (args.rounds + 1) * args.interval
    run_block(model, opt, batches, num_steps=args.rounds * args.interval, probe=probe, state=state,
              first_step=first, step_times=step_times)
    extra_s, paired = paired_overhead(step_times, args.interval)
    start = time.perf_counter()
    probe.save(step=first + args.rounds * args.interval)
    save_submit = time.perf_counter() - start
    probe.close()
    ratio = statistics.median(on) / statistics.median(off)
    return {"model": description, "device": str(device), "interval": args.interval, "rounds": args.rounds,
            "num_layers_probed": len(probe.layers), "off_block_s": off, "probe_block_s": on,
            "off_ms_per_step": 1e3 * statistics.median(off) / args.interval,
            "probe_ms_per_step": 1e3 * statistics.median(on) / args.interval,
            "ratio": ratio, "overhead_pct": 100 * (ratio - 1), "save_submit_ms": 1e3 * save_submit,
            "observed_step_extra_ms": 1e3 * extra_s, "paired_overhead_pct": 100 * paired}


def write_outputs(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rounds = range(1, len(result["off_block_s"]) + 1)
    ax.plot(rounds, [1e3 * t / result["interval"] for t in result["off_block_s"]], "o-", label="probe off")
    ax.plot(rounds, [1e3 * t / result["interval"] for t in result["probe_block_s"]], "s-", label="probe on")
    ax.set_xlabel("round")
    ax.set_ylabel("ms / step")
    ax.set_title(f"{result['model']} on {result['device']}: ratio {result['ratio']:.4f}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "probe_overhead.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="wukong")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_probe_overhead"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the model/data config")
    args = parser.parse_args(argv)
    result = measure(args)
    write_outputs(result, args.out)
    print(f"model {result['model']}  device {result['device']}  layers probed {result['num_layers_probed']}")
    print(f"{'':>10} {'ms/step':>10}")
    print(f"{'off':>10} {result['off_ms_per_step']:>10.3f}")
    print(f"{'probe':>10} {result['probe_ms_per_step']:>10.3f}")
    print(f"ratio probe/off = {result['ratio']:.4f}  (overhead {result['overhead_pct']:+.2f}%, target <= 1%)")
    print(f"paired estimate: observed step +{result['observed_step_extra_ms']:.2f} ms -> overhead "
          f"{result['paired_overhead_pct']:+.2f}% at interval {result['interval']}")
    print(f"save (merge + device clone, write in background): {result['save_submit_ms']:.2f} ms")
    print(f"wrote {args.out / 'probe_overhead.json'} and probe_overhead.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
