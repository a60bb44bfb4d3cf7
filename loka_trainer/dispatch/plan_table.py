"""Reading a Dispatch plan: why each GEMM stayed BF16 (``bf16_reason``), how many run in FP8, and the plan as the
text table that ``convert_to_loka`` logs (``format_plan_table``)."""
from __future__ import annotations

from typing import Optional

from loka_trainer.dispatch.plan import DispatchPlan, GemmChoice, gemm_is_fp8, gemm_label
from loka_trainer.dispatch.select import accuracy_rejection
from loka_trainer.kernels.backend_base import GEMMS
from loka_trainer.probe.flush import DEFAULT_MAX_FLUSHED_FRACTION


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


# Why a GEMM stayed BF16: every measured FP8 candidate failed the MERE test / failed the accuracy test, some of
# them only by flushing too much of an operand to zero (``probe.flush``) / the accurate ones were not fast enough /
# nothing was measured (e.g. a hand-written or probe-less plan entry) / its backend runs this GEMM in high precision
# (e.g. torchao_rowwise_with_gw_hp's weight grad).
BF16_REASONS = ("MERE", "flushed", "slow", "unmeasured", "hp")


def bf16_reason(choice: GemmChoice, *, mere_threshold: float, min_speedup: float,
                gemm: Optional[str] = None,
                max_flushed_fraction: float = DEFAULT_MAX_FLUSHED_FRACTION) -> Optional[str]:
    """For a GEMM left in BF16, which rule kept it there (one of ``BF16_REASONS``); None if it is not BF16.
    ``gemm``: which GEMM ``choice`` is for, so a backend running it in high precision counts as BF16 ("hp")."""
    if choice.backend != "bf16":
        return "hp" if gemm is not None and not gemm_is_fp8(choice.backend, gemm) else None
    measured = [c for name, c in choice.candidates.items()
                if name != "bf16" and c.get("mere") is not None and c.get("time_us") is not None]
    if not measured or choice.bf16_time_us is None:
        return "unmeasured"
    why = {accuracy_rejection(c, mere_threshold=mere_threshold, max_flushed_fraction=max_flushed_fraction)
           for c in measured}
    if why == {"MERE"}:
        return "MERE"
    if None not in why:
        return "flushed"
    return "slow"


def rejected_for_flush(choice: GemmChoice, *, mere_threshold: float,
                       max_flushed_fraction: float) -> dict[str, float]:
    """FP8 candidate -> its flushed fraction, for each candidate of ``choice`` that passed the MERE test but was
    rejected because it flushes more than ``max_flushed_fraction`` of an operand's nonzero values to zero."""
    return {name: c["flushed"] for name, c in choice.candidates.items()
            if name != "bf16" and accuracy_rejection(c, mere_threshold=mere_threshold,
                                                     max_flushed_fraction=max_flushed_fraction) == "flushed"}


def bf16_reason_counts(plan: DispatchPlan) -> dict[str, int]:
    """``BF16_REASONS`` -> how many GEMMs of ``plan`` stayed BF16 for that reason."""
    counts = dict.fromkeys(BF16_REASONS, 0)
    for lp in plan.layers.values():
        runs_fp8 = lp.runs_fp8()
        for g in GEMMS:
            if runs_fp8[g]:  # e.g. a fused Mods layer's timed FP8 input grad over a BF16 per-GEMM choice
                continue
            why = bf16_reason(getattr(lp, g), mere_threshold=plan.mere_threshold, min_speedup=plan.min_speedup,
                              gemm=g, max_flushed_fraction=plan.max_flushed_fraction)
            if why is not None:
                counts[why] += 1
    return counts


def num_fp8_gemms(plan: DispatchPlan) -> int:
    """How many GEMMs of ``plan`` run in FP8 (``LayerPlan.runs_fp8``)."""
    return sum(sum(lp.runs_fp8().values()) for lp in plan.layers.values())


def format_plan_table(plan: DispatchPlan) -> str:
    """The plan as a fixed-width text table: one row per layer and GEMM with the chosen backend's MERE, flushed
    fraction and speedup; a BF16 row says why it is BF16 (``bf16_reason``; a backend running that GEMM in high
    precision reads ``bf16 (via NAME)``); a GEMM with candidates rejected for flushing (``rejected_for_flush``)
    gets a line naming them. The last line counts FP8 GEMMs and the reasons for the rest."""
    w = 36  # the backend column: fits "bf16 (via torchao_rowwise_with_gw_hp)"
    lw = max([len("layer"), *map(len, plan.layers)])  # whole names: `precision.exclude` globs match them
    head = (f"{'layer':<{lw}} {'M×K×N':>18} {'gemm':<11} {'backend':<{w}} {'MERE':>8} {'flushed':>8} {'speedup':>8} "
            f"{'bf16 why':<10}")
    rows = [f"LoKA Dispatch plan ({plan.device}; MERE < {plan.mere_threshold}, flushed <= {plan.max_flushed_fraction},"
            f" speedup > {plan.min_speedup}×)", head, "-" * len(head)]
    rule = dict(mere_threshold=plan.mere_threshold, max_flushed_fraction=plan.max_flushed_fraction)
    num_flush_rejections = 0  # GEMMs with at least one FP8 candidate rejected for flushing
    for fqn, lp in plan.layers.items():
        shape = f"{lp.M}×{lp.K}×{lp.N}"
        for g in GEMMS:
            c = getattr(lp, g)
            why = bf16_reason(c, min_speedup=plan.min_speedup, gemm=g, **rule) or ""
            rows.append(f"{fqn:<{lw}} {shape:>18} {g:<11} {gemm_label(c.backend, g):<{w}} "
                        f"{_fmt(c.mere, '.4f'):>8} {_fmt(c.flushed, '.4f'):>8} {_fmt(c.speedup, '.2f'):>8} "
                        f"{why:<10}".rstrip())
            fqn, shape = "", ""
            rejected = rejected_for_flush(c, **rule)
            if rejected:
                num_flush_rejections += 1
                names = ", ".join(f"{name} {flushed:.4f}" for name, flushed in rejected.items())
                rows.append(f"{'':<{lw}} {'':>18} {'':<11} rejected, flushed > {plan.max_flushed_fraction}: {names}")
        mods_choices = (("mods fwd", None, lp.mods_forward), ("mods dgrad", "input_grad", lp.mods_input_grad))
        for label, gemm, choice in mods_choices:
            if choice is not None:
                mode = gemm_label(choice.mode, gemm) if gemm else choice.mode
                rows.append(f"{'':<{lw}} {'':>18} {label:<11} {mode:<{w}} {'-':>8} {'-':>8} "
                            f"{_fmt(choice.speedup, '.2f'):>8}")
    reasons = bf16_reason_counts(plan)
    mods_bf16 = sum(gemm_is_fp8(getattr(lp, g).backend, g) and not lp.runs_fp8()[g]
                    for lp in plan.layers.values() for g in ("forward", "input_grad"))
    hp = f", {reasons['hp']} (backend runs it in BF16)" if reasons["hp"] else ""
    rows.append(f"{num_fp8_gemms(plan)} of {3 * len(plan.layers)} GEMMs in FP8; BF16 kept for {reasons['MERE']} (no "
                f"FP8 candidate with MERE < {plan.mere_threshold}), {reasons['flushed']} (the others flush > "
                f"{plan.max_flushed_fraction} of an operand to zero), {reasons['slow']} (no accurate one > "
                f"{plan.min_speedup}× faster), {reasons['unmeasured']} (not measured), {mods_bf16} (fused Mods "
                f"layer timed faster in BF16){hp}; {num_flush_rejections} GEMM(s) with an FP8 candidate rejected for "
                f"flushing")
    return "\n".join(rows)
