"""train.py runs for the scripts that measure the user's path: how a run is launched (one process, or torchrun on
its own rendezvous port), one blocking run, and reading its logged throughput. Concurrent runs: ``run_queue``."""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from loka_trainer.dispatch.config import unread_precision_fields

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py and conf/
PRESETS = ROOT / "conf" / "precision"

# Precision variants that are not a conf/precision preset: name -> train.py overrides.
BF16_MODS = ["precision=loka", "precision.dispatch=false"]

PRECISION_VARIANTS: dict[str, list[str]] = {
    # The LoKA Mods (no bias, BlockNorm, Hard Swish: precision.mods builds them) in BF16 without FP8: with Dispatch
    # off, apply_precision leaves the model alone. LoKA's BF16 fused Mods layers compute the same function (in the
    # plain math or our kernels, whichever Dispatch timed faster), so LoKA vs this variant is the effect of its FP8
    # GEMMs alone.
    "bf16_mods": BF16_MODS,
    # BF16 + Mods with one Mod undone (which Mod costs quality where BF16 + Mods loses to BF16), and LoKA's Dispatch
    # on the published layers (FP8 without the Mods).
    "bf16_mods_bias": [*BF16_MODS, "model.mods.bias=true"],
    "bf16_mods_layernorm": [*BF16_MODS, "model.mods.norm=layernorm"],
    "bf16_mods_silu": [*BF16_MODS, "model.mods.activation=silu"],
    "loka_published": ["precision=loka", "precision.mods=false"],
    # torchao's recipes on the Linears its own size thresholds keep (precision.FP8_FILTERS "auto"): the speed
    # baseline, as torchtitan applies them; the presets convert every target Linear (uniform FP8).
    "fp8_tensorwise_auto": ["precision=fp8_tensorwise", "precision.fp8_filter=auto"],
    "fp8_rowwise_auto": ["precision=fp8_rowwise", "precision.fp8_filter=auto"],
}


def precision_overrides(variant: str) -> list[str]:
    """A precision variant -> its train.py overrides: ``PRECISION_VARIANTS``, else the preset `precision=<name>`."""
    return PRECISION_VARIANTS.get(variant, [f"precision={variant}"])


def known_variants() -> list[str]:
    return sorted({*PRECISION_VARIANTS, *(p.stem for p in PRESETS.glob("*.yaml"))})


def python_command(nproc: int, port: int) -> list[str]:
    """One process: train.py starts its own one-rank group from MASTER_ADDR/MASTER_PORT (set by ``run_env``)."""
    return [sys.executable, str(ROOT / "train.py")]


def torchrun_command(nproc: int, port: int) -> list[str]:
    """torchrun on one node, static rendezvous on ``port``: concurrent runs must not share a rendezvous store."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={port}", str(ROOT / "train.py")]


LAUNCHERS: dict[str, Callable[[int, int], list[str]]] = {"python": python_command, "torchrun": torchrun_command}


def free_port(taken: set[int]) -> int:
    """A TCP port the OS reports free on 127.0.0.1 that no running job of ours holds."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def run_env(port: int, *, threads: int, devices: Optional[str] = None) -> dict[str, str]:
    """The child's environment: its rendezvous port, (unless set) OMP threads = its share of the CPU cores, and
    with ``devices`` the GPUs it may see (``CUDA_VISIBLE_DEVICES``, e.g. ``"2,3"``)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def measured_overrides(run_dir: Path, overrides: list[str]) -> list[str]:
    """train.py's overrides for a measured run: ``overrides`` with evaluation once at the end on one batch, no
    checkpoints, no progress bar, into ``run_dir``."""
    return [*overrides, "trainer.eval_interval=0", "trainer.checkpoint_at_end=false", "trainer.checkpoint_interval=0",
            "trainer.resume=false", "callbacks.progress=false", "data.eval_batches=1", f"hydra.run.dir={run_dir}"]


def checked_run_configs(runs: list[list[str]]) -> list:
    """Compose and validate train.py's config of each override list before any run starts, as train.py does (a bad
    override: its one ``error:`` line, exit 2, instead of a failed run's log after the earlier runs); returns the
    typed configs (``loka_trainer.config.RunConfig``)."""
    from hydra.core.global_hydra import GlobalHydra

    from loka_trainer.cli import compose_config, typed_config
    from loka_trainer.config import register_schemas, to_run_config

    register_schemas()
    composed = [compose_config("config", overrides) for overrides in runs]
    configs = [typed_config(cfg, lambda c, choices=choices: to_run_config(c, choices)) for cfg, _, choices in composed]
    GlobalHydra.instance().clear()
    return configs


def composed_precisions(runs: list[list[str]]) -> list:
    """The composed ``precision`` node of each override list's config (Hydra alone: nothing validated, no file or
    device looked at; a bad override: its one ``error:`` line, exit 2)."""
    from hydra.core.global_hydra import GlobalHydra

    from loka_trainer.cli import compose_config
    from loka_trainer.config import register_schemas

    register_schemas()
    precisions = [compose_config("config", overrides)[0].precision for overrides in runs]
    GlobalHydra.instance().clear()
    return precisions


def composed_unread_precision(overrides: list[str]) -> frozenset[str]:
    """``unread_precision_fields`` of the config ``overrides`` compose (``composed_precisions``)."""
    p = composed_precisions([overrides])[0]
    return unread_precision_fields(p.dispatch, p.fp8_recipe, p.plan)


def logged_windows_after(steps: int, log_interval: int, warmup_steps: int) -> int:
    """How many log windows a run of ``steps`` logs after ``warmup_steps`` (it logs at the multiples of
    ``log_interval``)."""
    return max(0, steps // log_interval - warmup_steps // log_interval)


def check_measured_runs(runs: list[list[str]], warmup_steps: int) -> None:
    """Before any run: each override list's config is valid (``checked_run_configs``) and logs the two windows after
    the warm-up that throughput and its spread are read from (else that is found after the run trained). Checked in
    a child process: a config check that names the device (a plan file's backends) would start a CUDA context in
    this one, which stays off the GPU while the runs train. A failure exits here with the child's status."""
    code = ("import json, sys; from scripts.train_runs import check_measured_configs as check; "
            "check(json.loads(sys.argv[1]), int(sys.argv[2]))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(runs), str(warmup_steps)], cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)


def check_measured_configs(runs: list[list[str]], warmup_steps: int) -> None:
    """``check_measured_runs`` in this process: one ``error:`` line and exit 2 on the first problem."""
    from loka_trainer.cli import fail

    for cfg in checked_run_configs([measured_overrides(Path("unused"), overrides) for overrides in runs]):
        t = cfg.trainer
        if (windows := logged_windows_after(t.steps, t.log_interval, warmup_steps)) < 2:
            fail(f"trainer.steps={t.steps} logs {windows} window(s) after --warmup-steps {warmup_steps} (one every "
                 f"trainer.log_interval={t.log_interval} steps); throughput needs 2: train longer")


def train(run_dir: Path, overrides: list[str], nproc: int) -> list[dict]:
    """Run train.py once under torchrun (``measured_overrides``); returns its metrics.jsonl records (raises with
    the log's tail on failure)."""
    cmd = [*torchrun_command(nproc, free_port(set())), *measured_overrides(run_dir, overrides)]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed ({proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged_after(records: list[dict], key: str, warmup_steps: int) -> list[float]:
    """``key`` of every metrics.jsonl record that logged it after the warm-up."""
    return [r[key] for r in records if key in r and r["step"] > warmup_steps]


def steady_throughput(records: list[dict], warmup_steps: int) -> float:
    """Mean examples/s over logged train steps after the warm-up."""
    values = logged_after(records, "examples_per_s", warmup_steps)
    if not values:
        raise SystemExit(f"no logged step after --warmup-steps {warmup_steps}: train longer")
    return statistics.fmean(values)


def steady_data_wait(records: list[dict], warmup_steps: int) -> Optional[float]:
    """Mean host ms per step the loop waited for its next batch (``data_wait_ms``) over the logged windows after the
    warm-up; None where the run logged none (a train.py older than the metric)."""
    values = logged_after(records, "data_wait_ms", warmup_steps)
    return statistics.fmean(values) if values else None


def data_wait_share(data_wait_ms: Optional[float], examples_per_s: float, examples_per_step: int) -> Optional[float]:
    """The share of the mean step the loop spent waiting for its next batch: ``data_wait_ms`` over the step time
    ``1000 · examples_per_step / examples_per_s`` (examples of all ranks); None where the run logged no wait."""
    if data_wait_ms is None:
        return None
    return data_wait_ms / (1000.0 * examples_per_step / examples_per_s)


def window_spread(trajectory: list[list[float]], warmup_steps: int) -> float:
    """How unsteady a run was: (90th − 10th percentile) / median of its log windows' examples/s after the warm-up.
    A steady run is a few percent; a machine slowdown during the run shows as tens of percent, however the mean
    came out, so a ratio of two runs is only as good as the larger of their spreads."""
    rates = sorted(r for s, r in trajectory if s > warmup_steps)
    if len(rates) < 2:
        raise SystemExit(f"need two logged windows after --warmup-steps {warmup_steps}: train longer")
    deciles = statistics.quantiles(rates, n=10, method="inclusive")
    return (deciles[-1] - deciles[0]) / statistics.median(rates)


def repeat_orders(names: list[str], repeats: int) -> list[list[str]]:
    """The run order of each repeat: as given in even repeats, reversed in odd ones (A B C, C B A, A B C, ...), so a
    slow phase of the machine does not always fall on the same precision's runs."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(repeats)]


def throughput_trajectory(records: list[dict]) -> list[list[float]]:
    """[[step, examples/s of the log window ending there], ...] of every logged train step."""
    return [[r["step"], r["examples_per_s"]] for r in records if "examples_per_s" in r]



def observes(start: int, stop: int, interval: int) -> bool:
    """Whether the probe observes a step in [start, stop) at this interval (it observes the multiples of it)."""
    return any(t % interval == 0 for t in range(start, stop))


def observed_step_overhead(trajectory: list[list[float]], *, interval: int, warmup_steps: int,
                           neighbors: int = 4) -> dict:
    """The probe's cost read inside one probe-on run, free of run-to-run noise.

    ``trajectory``: [[step, examples/s], ...] of log windows of L steps each; the window logged at step s covers
    steps s - L .. s - 1 (0-based), and it was observed when one of them is a multiple of ``interval``. A window's
    time is proportional to 1 / rate. Each observed window after ``warmup_steps`` is compared with the median time
    of its ``neighbors`` nearest unobserved windows (by step; a slow phase of the machine then raises both alike);
    its extra time, in windows, summed over the observed windows and divided by the number of measured windows,
    is the overhead at this interval. Returns {"observed_windows": [s, ...], "extra_steps_per_observation": the
    mean extra time of one observation in steps, "overhead": fraction}.
    """
    length = int(trajectory[1][0] - trajectory[0][0]) if len(trajectory) > 1 else 0
    measured = [(int(s), r) for s, r in trajectory if s > warmup_steps]
    observed = [(s, r) for s, r in measured if observes(s - length, s, interval)]
    plain = [(s, r) for s, r in measured if not observes(s - length, s, interval)]
    if not observed or not plain:
        raise SystemExit("need observed and unobserved log windows after the warm-up: train longer")
    extra = []  # per observed window, in windows of its neighbors' median time
    for s, r in observed:
        nearest = sorted(plain, key=lambda w: abs(w[0] - s))[:neighbors]
        extra.append(1.0 / r / statistics.median(1.0 / q for _, q in nearest) - 1.0)
    return {"observed_windows": [s for s, _ in observed],
            "extra_steps_per_observation": length * statistics.fmean(extra),
            "overhead": sum(extra) / len(measured)}


def profile_overrides(step: Optional[int]) -> list[str]:
    """train.py overrides that profile one step (``callbacks.profiler``; none for None)."""
    if step is None:
        return []
    return ["callbacks.profiler.enabled=true", f"callbacks.profiler.start_step={step}",
            "callbacks.profiler.num_steps=1"]


def check_profile_step(step: Optional[int], warmup_steps: int) -> None:
    """A profiled step is slowed by the profiler, so it must lie inside the warm-up that throughput leaves out."""
    if step is not None and not 0 <= step < warmup_steps:
        raise SystemExit(f"error: --profile-step {step} must be inside the warm-up (0 <= step < --warmup-steps "
                         f"{warmup_steps}): the profiler slows the step it profiles")


def measured_run(run_dir: Path, overrides: list[str], nproc: int, *, warmup_steps: int,
                 profile_step: Optional[int] = None) -> dict:
    """One train.py run as the throughput benchmarks record it: {"examples_per_s" (after the warm-up),
    "window_spread", "data_wait_ms" (`steady_data_wait`), "data_wait_share" (of the step, `data_wait_share`),
    "trajectory", "peak_gpu_memory_gib" (``summary.json``), and with ``profile_step`` "profile" (that step by phase
    and kernel kind, ``profile.json``)}."""
    records = train(run_dir, [*overrides, *profile_overrides(profile_step)], nproc)
    trajectory = throughput_trajectory(records)
    summary = json.loads((run_dir / "summary.json").read_text())
    examples_per_step = OmegaConf.load(run_dir / ".hydra" / "config.yaml").data.batch_size * summary["world_size"]
    run = {"examples_per_s": steady_throughput(records, warmup_steps),
           "window_spread": window_spread(trajectory, warmup_steps),
           "data_wait_ms": steady_data_wait(records, warmup_steps),
           "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"),
           "trajectory": trajectory}
    run["data_wait_share"] = data_wait_share(run["data_wait_ms"], run["examples_per_s"], examples_per_step)
    if profile_step is not None:
        run["profile"] = json.loads((run_dir / "profile.json").read_text())["steps"][0]
    return run


def print_phase_table(step: int, runs: dict[str, dict]) -> None:
    """Each run's profiled step by phase: host ms / GPU kernel ms."""
    print(f"step {step} by phase, host ms / GPU kernel ms (callbacks.profiler):")
    for key, run in runs.items():
        phases = run.get("profile", {}).get("phases")  # a run reused from a call without --profile-step: none
        print(f"{key:>22}  " + ("not profiled" if phases is None else "  ".join(
            f"{name} {t['host_ms']:.1f}/{t['gpu_ms']:.1f}" for name, t in phases.items())))
