"""Dispatch's choice: the LoKA rule as pure functions of measured numbers (MERE, flushed fraction, µs).

Rule (paper III-C): keep candidates with MERE < threshold and speedup over BF16 > min_speedup at the layer's
real shape on this device; the fastest wins; otherwise BF16. A candidate must also not cast more than
``max_flushed_fraction`` of the nonzero values of the layer's real input or weight to zero (``probe.flush``): MERE
is relative to the output and misses small inputs wiped out by an outlier that sets a shared scale.

Times come in independent rounds (each round
times every candidate once, interleaved, so drift hits all of them alike, ``measure.time_rounds``): a candidate
passes ``min_speedup`` only if it does so in *every* round against that round's BF16 time, so one noisy
repeat (a 7892 µs BF16 outlier among 36-70 µs neighbours) cannot put a GEMM on FP8. The fastest is the one with
the lowest median.
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence, Union

from loka_trainer.kernels.backends import BASELINE
from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION

# Why an FP8 candidate failed the accuracy test: its MERE is unknown or >= the threshold / it flushes too much of
# an operand to zero.
REJECTIONS = ("MERE", "flushed")

Times = Union[float, Sequence[float], None]  # one time (µs) or one per round


def as_rounds(times: Times) -> Optional[list[float]]:
    """One time or one per round -> the list of per-round times (µs); None (or no round) -> None."""
    if times is None:
        return None
    rounds = [float(times)] if isinstance(times, (int, float)) else [float(t) for t in times]
    return rounds or None


def round_times(candidate: dict, key: str = "times_us") -> Optional[list[float]]:
    """A candidate entry's per-round times (µs): its ``times_us`` list, else ``[time_us]``; None when unknown."""
    return as_rounds(candidate.get(key)) or as_rounds(candidate.get("time_us"))


def outlier_rounds(times: Sequence[float], factor: float) -> list[int]:
    """Indices of rounds whose time is more than ``factor`` × the median of the other rounds (a preempted or
    interrupted repeat). Needs at least two rounds."""
    if len(times) < 2:
        return []
    return [i for i, t in enumerate(times)
            if t > factor * statistics.median([u for j, u in enumerate(times) if j != i])]


def wins_every_round(times: Sequence[float], bf16_times: Sequence[float], min_speedup: float) -> bool:
    """True if bf16 / candidate > ``min_speedup`` in every round (rounds paired by index when both were timed
    in the same rounds; otherwise the candidate's slowest round against BF16's fastest)."""
    if not times or not bf16_times or min(times) <= 0:
        return False
    if len(times) == len(bf16_times):
        return all(b / t > min_speedup for t, b in zip(times, bf16_times))
    return min(bf16_times) / max(times) > min_speedup


def accuracy_rejection(candidate: dict, *, mere_threshold: float,
                       max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION) -> Optional[str]:
    """Why a candidate's evidence {"mere": float|None, "flushed": float|None (optional)} fails the accuracy test
    (one of ``REJECTIONS``), or None when it passes: MERE unknown or >= ``mere_threshold`` -> "MERE"; flushed
    fraction > ``max_flushed_fraction`` -> "flushed" (an unknown flushed fraction, e.g. a backend that declares no
    scaling, does not reject)."""
    err, flushed = candidate.get("mere"), candidate.get("flushed")
    if err is None or not err < mere_threshold:
        return "MERE"
    if flushed is not None and flushed > max_flushed_fraction:
        return "flushed"
    return None


def select_backend(candidates: dict[str, dict], bf16_time_us: Times, *, mere_threshold: float,
                   min_speedup: float, max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION) -> str:
    """Pick one GEMM's backend: candidates maps name -> {"mere": float|None, "flushed": float|None (optional),
    "time_us": median µs|None, "times_us": [µs per round] (optional)}; ``bf16_time_us``: BF16's time, or its
    times per round.

    A candidate qualifies when it passes the accuracy test (``accuracy_rejection``: MERE < mere_threshold and
    flushed fraction <= max_flushed_fraction) and beats BF16 by more than min_speedup in every round
    (``wins_every_round``); unknown MERE or times disqualify. The qualifying candidate with the lowest median
    time wins; none -> "bf16". Candidates given here must run the GEMM in FP8 (``measure_gemm`` leaves out a
    backend whose GEMM is high precision: it is BF16).
    """
    bf16_rounds = as_rounds(bf16_time_us)
    if bf16_rounds is None:
        return BASELINE
    best, best_time = BASELINE, None
    for name, c in candidates.items():
        rounds = round_times(c)
        if name == BASELINE or rounds is None or \
                accuracy_rejection(c, mere_threshold=mere_threshold, max_flushed_fraction=max_flushed_fraction):
            continue
        median = statistics.median(rounds)
        if wins_every_round(rounds, bf16_rounds, min_speedup) and \
                (best_time is None or median < best_time):
            best, best_time = name, median
    return best


def select_mods_mode(times_us: dict[str, Times], is_fp8: dict[str, bool], *,
                     min_speedup: float) -> tuple[str, Optional[float]]:
    """Pick a fused Mods layer's forward mode (or input-grad backend) from measured times (µs, one or one per
    round; None = failed): the BF16 option with the lowest median, unless an FP8 one in ``is_fp8`` (only offered
    where it passed the accuracy test) beats it by more than ``min_speedup`` in every round
    (``wins_every_round``); the fastest such FP8 option by median wins. Returns (choice, median speedup over
    that BF16 option)."""
    rounds = {m: r for m, t in times_us.items() if (r := as_rounds(t)) is not None}
    medians = {m: statistics.median(r) for m, r in rounds.items() if min(r) > 0}
    bf16_modes = [m for m in medians if not is_fp8[m]]
    if not bf16_modes:
        raise ValueError(f"select_mods_mode: no BF16 mode was measured: {times_us}")
    bf16 = min(bf16_modes, key=medians.__getitem__)
    winners = [m for m in medians if is_fp8[m] and wins_every_round(rounds[m], rounds[bf16], min_speedup)]
    if winners:
        fp8 = min(winners, key=medians.__getitem__)
        return fp8, medians[bf16] / medians[fp8]
    return bf16, 1.0
