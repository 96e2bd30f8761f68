"""The rows each check of a trained torch/JAX pair makes (the checks: `parity.verdicts.checks.CHECKS`).

A check says what series is compared, by which tolerance rule, and which power bound its
quantity has; a recipe names the trajectory checks that apply to it
(`parity.core.recipes.Recipe.verdict_checks`), the others apply wherever their series was
recorded. Each builder takes the pair's one context (`parity.verdicts.judge.Pair`: runs,
envelope, per-step tolerances, seed groups) and returns `Row` drafts; `parity.verdicts.judge`
applies the qualifiers (`parity.verdicts.qualifiers`) and freezes them into `Verdict` rows.

The rules each builder applies (what is compared, by which tolerance, in which windows) are
written once, for users, in the documentation page "What a PASS means"
(``docs/harness/verdicts.md``); the constants and the reason for each value are
`parity.verdicts.tolerances.CONSTANTS`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from parity.core.records import run_label
from parity.verdicts.gaps import final_mean, run_losses, self_divergence, signal_gaps
from parity.verdicts.rows import LOSS_UNIT, Row, fmt_value, power_bound
from parity.verdicts.tolerances import POWER_BOUNDS, TOLERANCES, step_band, step_tolerances

__all__ = ["equivalence"]


# --- the fp32 per-step loss ---------------------------------------------------------------------


def loss_windows(pair) -> list[Row]:
    """Windows 0-9 and 10-29 (and the rest with calibration runs), each split at the horizon
    where its tolerance climbs above the loss bound."""
    gaps, tolerances, envelope = pair.gaps, pair.tolerances, pair.envelope
    n = len(gaps)
    if n == 0:
        return [
            Row(
                "loss",
                "per-step loss",
                "no steps on both sides",
                "at least one step",
                False,
                "nothing to compare: a run recorded no steps",
                mode="fixed bands",
            )
        ]
    first, second = TOLERANCES["fp32_first"][0], TOLERANCES["fp32_next"][0]
    windows = [(0, first), (first, second)]
    if envelope is not None and n > second:
        windows.append((second, n))
    rows: list[Row] = []
    for start, stop in windows:
        stop = min(stop, n)
        if start >= stop:
            continue
        power = max(tolerances[start:stop])
        row = _compare_window(pair, start, stop)
        if row.passed is True and power > POWER_BOUNDS["loss"]:
            rows += split_at_horizon(
                pair, "loss", "per-step loss", gaps, tolerances, start, stop, "loss"
            )
        else:
            row.power = power
            rows.append(row)
    covered = max((r.window[1] for r in rows if r.window), default=0)
    if covered < n:
        rows += split_at_horizon(
            pair, "loss", "per-step loss", gaps, tolerances, covered, n, "loss", late=True
        )
    return rows


def _judged(gaps, tolerances, start: int, stop: int) -> tuple[list[int], int, int]:
    """Steps [start, stop) against their tolerances: the failing steps, the worst step's index
    in the window (by gap over tolerance, then gap) and the judged one's (the first failing,
    else the worst)."""
    segment, tols = gaps[start:stop], tolerances[start:stop]
    failing = _failing(gaps, tolerances, start, stop)
    worst = max(range(len(segment)), key=lambda i: (segment[i] / tols[i], segment[i]))
    return failing, worst, failing[0] - start if failing else worst


def _failing(gaps, tolerances, start: int, stop: int) -> list[int]:
    """The steps in [start, stop) whose gap is not within its tolerance (a NaN gap fails)."""
    stop = min(stop, len(gaps), len(tolerances))
    return [s for s in range(start, stop) if not gaps[s] <= tolerances[s]]


def _compare_window(pair, start: int, stop: int) -> Row:
    gaps, tolerances, envelope = pair.gaps, pair.tolerances, pair.envelope
    ref, cand = pair.ref, pair.cand
    ref_l, cand_l = pair.ref_losses, pair.cand_losses
    k = TOLERANCES["noise_k"]
    step0 = gaps[0] if gaps else None
    window_tols = tolerances[start:stop]
    deciders = [
        "noise-calibrated" if t > step_band(s) else "fixed bands"
        for s, t in zip(range(start, stop), window_tols, strict=True)
    ]
    segment = gaps[start:stop]
    failing, worst_i, judge_i = _judged(gaps, tolerances, start, stop)
    worst_step = start + worst_i
    mode = "noise-calibrated" if "noise-calibrated" in deciders else "fixed bands"
    a, b = ref_l[worst_step], cand_l[worst_step]
    absolute = abs(a - b) if a is not None and b is not None else None
    parts = [f"step-0 gap {fmt_value(step0)} relative"]
    if failing:
        parts.append(
            f"first failing step {failing[0]} ({len(failing)} of {stop - start} steps fail)"
        )
    else:
        parts.append("no step fails")
    parts.append(
        f"worst step {worst_step}: {fmt_value(segment[worst_i])} relative ({fmt_value(absolute, LOSS_UNIT)}; "
        f"{run_label(ref)} {fmt_value(a)}, {run_label(cand)} {fmt_value(b)}) vs tolerance {fmt_value(window_tols[worst_i])}"
    )
    if envelope is not None:
        s = start + judge_i
        lag = TOLERANCES["noise_lag"]
        env_s = envelope[min(s + lag, len(envelope) - 1)]
        parts.append(
            f"self-divergence ({pair.calibrated_by}) by step {s}+{lag}: {fmt_value(env_s)}; tolerance at step {s} "
            f"{fmt_value(window_tols[judge_i])} from the {deciders[judge_i]}"
            + (
                f" (k={k:g}, rescaled x{pair.ratio:.3g} to the step-0 gap)"
                if deciders[judge_i] != "fixed bands"
                else ""
            )
        )
    if envelope is None or mode == "fixed bands":
        tolerance_value: Any = step_band(start)
    else:
        tolerance_value = f"max({step_band(start):.0e}, {k:g} x envelope)"
    return Row(
        "loss",
        f"per-step loss, steps {start}-{stop - 1}",
        segment[judge_i],
        tolerance_value,
        not failing,
        "; ".join(parts),
        mode=mode,
        window=(start, stop),
        first_failing_step=failing[0] if failing else None,
        worst_step=worst_step,
        step0_gap=step0,
        absolute=absolute,
        unit=LOSS_UNIT,
    )


def split_at_horizon(
    pair, kind, prefix, gaps, tolerances, start, stop, what, calibrated=None, late=False
) -> list[Row]:
    """Per-step rows over steps [start, stop) of a series: uncalibrated, the steps from the
    chaos step on in a window of their own; each window split at its horizon (the last step
    whose tolerance is within the bound, counting from its start)."""
    calibrated = pair.calibrated if calibrated is None else calibrated
    chaos = TOLERANCES["chaos_step"]
    if calibrated or stop <= chaos:
        pieces = [(start, stop)]
    else:
        split = max(start, chaos)
        pieces = [(start, split), (split, stop)]
    rows: list[Row] = []
    for a, b in pieces:
        rows += _horizon(pair, kind, prefix, gaps, tolerances, a, b, what, calibrated)
    for row in rows:
        row.split_at_chaos = not calibrated
        row.late = late or row.late
    return rows


# Why a window past its horizon decides nothing: (the cause, with {low}, {high} and {bound};
# the remedy; the label's words; the mode where a step exceeds even that tolerance).
_CALIBRATED_CAUSE = (
    "the model's own divergence makes the tolerance {low}-{high}, above the bound {bound}",
    "(inconclusive; seed statistics decide: --seeds)",
    "beyond the horizon",
    "noise-calibrated",
)


def _horizon(
    pair, kind, prefix, gaps, tolerances, start, stop, what, calibrated, cause=_CALIBRATED_CAUSE
) -> list[Row]:
    if start >= stop:
        return []
    bound = power_bound(kind)
    horizon = start
    while horizon < stop and tolerances[horizon] <= bound:
        horizon += 1
    rows = []
    if horizon > start:
        label = f"{prefix}, steps {start}-{horizon - 1}"
        if horizon < stop:
            label += " (horizon)"
        row = _window_row(kind, label, gaps, tolerances, start, horizon, bound, what, calibrated)
        if horizon == 1:  # step 0 alone: the gate's business, never what makes a PASS
            row.mode = "step 0"
        rows.append(row)
    if horizon < stop:
        rows.append(
            _beyond_row(
                kind,
                f"{prefix}, steps {horizon}-{stop - 1} ({cause[2]})",
                gaps,
                tolerances,
                horizon,
                stop,
                bound,
                what,
                cause,
            )
        )
    return rows


def _window_row(kind, check, gaps, tolerances, start, stop, bound, what, calibrated) -> Row:
    segment = gaps[start:stop]
    tols = tolerances[start:stop]
    failing, worst, judge_i = _judged(gaps, tolerances, start, stop)
    return Row(
        kind,
        check,
        segment[judge_i],
        max(tols),
        not failing,
        f"{what}: "
        + (
            f"first failing step {failing[0]} ({len(failing)} of {stop - start} fail); "
            if failing
            else "no step fails; "
        )
        + f"worst step {start + worst}: {fmt_value(segment[worst])} relative against "
        f"{fmt_value(tols[worst])}; could detect a relative difference of "
        f"{fmt_value(min(tols))} at its most sensitive step, {fmt_value(max(tols))} at every "
        f"step (bound {fmt_value(bound)})",
        mode="noise-calibrated" if calibrated else "fixed bands",
        window=(start, stop),
        first_failing_step=failing[0] if failing else None,
        worst_step=start + worst,
        power=max(tols),
    )


def _beyond_row(kind, check, gaps, tolerances, start, stop, bound, what, cause) -> Row:
    segment, tols = gaps[start:stop], tolerances[start:stop]
    failing = _failing(gaps, tolerances, start, stop)
    why = cause[0].format(
        low=fmt_value(min(tols)), high=fmt_value(max(tols)), bound=fmt_value(bound)
    )
    return Row(
        kind,
        check,
        max(segment),
        max(tols),
        False if failing else None,
        f"{what} {cause[2]}: {why}"
        + (
            f"; yet step {failing[0]} exceeds even that"
            if failing
            else f": these steps could not have failed a port bug and decide nothing {cause[1]}"
        ),
        mode=cause[3] if failing else "inconclusive",
        window=(start, stop),
        first_failing_step=failing[0] if failing else None,
        power=max(tols),
    )


# --- fp8, final loss ----------------------------------------------------------------------


def fp8_loss(pair) -> list[Row]:
    """Step 0 at the fp32 band (both sides hold the same fp8 codes there), steps 1-9 at e4m3's
    unit roundoff (a summation-order flip moves a code by one step)."""
    gaps = pair.gaps[: TOLERANCES["fp32_first"][0]]
    if not gaps:
        return [
            Row("fp8 loss", "per-step loss", "no steps on both sides", "at least one step", False)
        ]
    band = TOLERANCES["fp8_step_band"]
    tolerances = [step_band(0)] + [band] * (len(gaps) - 1)
    failing = _failing(gaps, tolerances, 0, len(gaps))
    worst = max(range(len(gaps)), key=lambda i: gaps[i] / tolerances[i])
    return [
        Row(
            "fp8 loss",
            f"per-step loss, steps 0-{len(gaps) - 1} (fp8)",
            gaps[worst],
            f"{fmt_value(step_band(0))} at step 0, {fmt_value(band)} after",
            not failing,
            f"step-0 gap {fmt_value(gaps[0])} relative; worst step {worst}"
            + (f"; first failing step {failing[0]}" if failing else ""),
            mode="fixed bands",
            window=(0, len(gaps)),
            step0_gap=gaps[0],
            worst_step=worst,
        )
    ]


def final_loss(pair) -> list[Row]:
    """The mean of the last losses within the final-loss band (or k x the envelope at the end)."""
    ref, cand = pair.ref, pair.cand
    window = TOLERANCES["final_window"]
    ref_l, cand_l = pair.ref_losses, pair.cand_losses
    a, b = final_mean(ref_l, window), final_mean(cand_l, window)
    floor = pair.floor
    value = math.inf if a is None or b is None else abs(a - b) / max(abs(a), floor, 1e-30)
    tolerance, env_final = pair.final_band()
    mode = "fixed bands"
    detail = (
        f"{run_label(ref)} {fmt_value(a, LOSS_UNIT)}, {run_label(cand)} {fmt_value(b, LOSS_UNIT)}; "
        f"difference {fmt_value(None if a is None or b is None else abs(a - b), LOSS_UNIT)}, "
        f"relative to max(|{run_label(ref)}|, floor {fmt_value(floor, LOSS_UNIT)} = 1% of the first loss)"
    )
    if tolerance > TOLERANCES["final_loss_rel"]:
        mode = "noise-calibrated"
        detail += (
            f"; self-divergence at the end {fmt_value(env_final)}: tolerance k x envelope "
            "(one run cannot tell chaos from a port bug here: use seed statistics)"
        )
    passed: bool | None = value <= tolerance
    if pair.seeds_decide:
        passed, mode = None, "informational"
        detail += "; decided by the seed statistics row"
    n = len(ref_l)
    return [
        Row(
            "final loss",
            f"final loss (mean of last {window})",
            value,
            tolerance,
            passed,
            detail,
            mode=mode,
            window=(max(0, n - window), n),
            absolute=None if a is None or b is None else abs(a - b),
            unit=LOSS_UNIT,
        )
    ]


def max_gap(pair) -> list[Row]:
    """Informational: the largest per-step loss gap over the whole run."""
    gaps, envelope = pair.gaps, pair.envelope
    if not gaps:
        return []
    finite = [g for g in gaps if math.isfinite(g)]
    worst = max(finite) if finite else math.inf
    return [
        Row(
            "max gap",
            "max per-step loss difference (all steps)",
            worst,
            "—",
            None,
            f"step-0 gap {fmt_value(gaps[0])}; worst at step {gaps.index(worst) if finite else '—'}"
            + (f"; self-divergence at the end {fmt_value(envelope[-1])}" if envelope else ""),
            mode="informational",
            window=(0, len(gaps)),
            step0_gap=gaps[0],
            worst_step=gaps.index(worst) if finite else None,
        )
    ]


def eval_metric(pair) -> list[Row]:
    """Informational: the eval metric of each side."""
    ref, cand = pair.ref, pair.cand
    ea, eb = ref["summary"].get("eval_metric"), cand["summary"].get("eval_metric")
    if ea is None or eb is None:
        return []
    name = ref["summary"].get("eval_metric_name", "metric")
    return [
        Row(
            "eval",
            f"eval {name}: {run_label(ref)} {ea:.4g}, {run_label(cand)} {eb:.4g}",
            abs(ea - eb),
            "—",
            None,
            mode="informational",
            absolute=abs(ea - eb),
            unit="" if name == "accuracy" else LOSS_UNIT,
        )
    ]


# --- gradient and update norms -------------------------------------------------------------------


def signals(pair) -> list[Row]:
    """Per-step gradient norm and update norm rows, where both runs recorded them."""
    n = len(pair.gaps)
    factor = TOLERANCES["signal_factor"]
    rows: list[Row] = []
    for field, kind, name in (
        ("grad_norm", "grad norm", "gradient norm"),
        ("update_norm", "update norm", "update norm"),
    ):
        signal = signal_gaps(pair.ref, pair.cand, field)
        if signal is None or not n:
            continue
        signal = [0.0 if s in pair.skipped_apart else g for s, g in enumerate(signal)]
        m = min(len(signal), n)
        own = None
        if pair.fp32:
            tols = [factor * t for t in pair.tolerances[:m]]
            own = self_divergence(
                pair.noise, pair.mains, functools.partial(signal_gaps, field=field)
            )
            if own:  # the signal's own rounding divergence, where it outruns the loss's
                own_tols = step_tolerances(signal[:m], own)
                tols = [max(t, o) for t, o in zip(tols, own_tols, strict=False)]
        else:  # below float32: the final-loss band per step, as a rounding-level check
            tols = [factor * TOLERANCES["final_loss_rel"]] * m
        what = (
            f"{name} (unscaled, before clipping; {factor:g} x the loss tolerance"
            + (", or its own noise-calibrated tolerance where larger)" if own else ")")
            if field == "grad_norm"
            else f"{name} (||params after - params before||)"
        )
        if not pair.fp32:  # a fixed band: no chaos split, no horizon, its own cause
            fixed = _horizon(
                pair, kind, f"per-step {name}", signal[:m], tols, 0, m, what, False, _FIXED_CAUSE
            )
            for row in fixed:
                row.late = True
            rows += fixed
            continue
        rows += split_at_horizon(
            pair,
            kind,
            f"per-step {name}",
            signal[:m],
            tols,
            0,
            m,
            what,
            calibrated=pair.calibrated,
            late=True,
        )
    return rows


# Below float32 a norm is held to `signal_factor` x the final-loss band: a fixed band, set by the
# precision, not by the model's divergence; no calibration or seed count changes it.
_FIXED_CAUSE = (
    "below float32 the band is fixed at {high} (signal_factor x the final-loss band), above the "
    "bound {bound}",
    "(no power at this precision: a calibration run or more seeds would not change a fixed "
    "band; the final loss decides here, and the fp32 cell judges the norms step by step)",
    "no power",
    "fixed bands",
)


# --- seed statistics ----------------------------------------------------------------------------


def _welch(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(t, degrees of freedom, two-sided p) of Welch's test; p = 1 when both have no spread."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var_x = sum((x - mean_x) ** 2 for x in xs) / (len(xs) - 1)
    var_y = sum((y - mean_y) ** 2 for y in ys) / (len(ys) - 1)
    se2 = var_x / len(xs) + var_y / len(ys)
    if se2 == 0:
        return (
            (0.0 if mean_x == mean_y else math.inf),
            math.nan,
            1.0 if mean_x == mean_y else 0.0,
        )
    from scipy import stats  # on first use: scipy.stats takes ~0.5 s to import

    result = stats.ttest_ind(xs, ys, equal_var=False)
    df = se2**2 / ((var_x / len(xs)) ** 2 / (len(xs) - 1) + (var_y / len(ys)) ** 2 / (len(ys) - 1))
    return float(result.statistic), float(df), float(result.pvalue)


def _seed_series(refs):
    window = TOLERANCES["final_window"]
    name = refs[0]["summary"].get("eval_metric_name", "metric")
    return [
        ("loss", "final loss", lambda r: final_mean(run_losses(r), window), "loss"),
        ("eval", f"eval {name}", lambda r: r["summary"].get("eval_metric"), name),
    ]


def welch(pair) -> list[Row]:
    """Welch's t-test of final loss and eval metric over the seeds (a difference test)."""
    refs, cands = pair.seed_refs, pair.seed_cands
    alpha = 1 - TOLERANCES["seed_confidence"]
    first_losses = [run_losses(r)[0] for r in refs if r["steps"] and run_losses(r)[0] is not None]
    floor_loss = TOLERANCES["final_loss_floor_frac"] * (
        sum(abs(x) for x in first_losses) / len(first_losses) if first_losses else 0.0
    )
    rows = []
    for series, label, get, metric in _seed_series(refs):
        accuracy = metric == "accuracy"
        floor = TOLERANCES["seed_accuracy_floor"] if accuracy else floor_loss
        unit = "" if accuracy else LOSS_UNIT
        kind = f"welch {series}"
        xs, ys = [get(r) for r in refs], [get(r) for r in cands]
        if any(v is None for v in xs + ys):
            if series == "eval" and all(v is None for v in xs + ys):
                continue
            rows.append(
                Row(
                    kind,
                    f"{label} over seeds (Welch t-test)",
                    "missing values",
                    f"p >= {alpha:g}",
                    False,
                    "a seed run has no finite final value",
                    mode="seed statistics",
                    unit=unit,
                )
            )
            continue
        t, df, p = _welch(xs, ys)
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        sd = lambda v, m: (sum((a - m) ** 2 for a in v) / (len(v) - 1)) ** 0.5  # noqa: E731
        difference = abs(mean_y - mean_x)
        u = (" " + unit) if unit else ""
        rows.append(
            Row(
                kind,
                f"{label} over seeds (Welch t-test)",
                p,
                f"p >= {alpha:g} or diff <= floor",
                p >= alpha or difference <= floor,
                f"Welch's two-sample t-test, two-sided, {TOLERANCES['seed_confidence']:.0%} confidence: "
                f"t = {t:.3g}, df = {df:.3g}, p = {p:.3g}; {run_label(refs[0])} {mean_x:.4g} ± {sd(xs, mean_x):.2g}, "
                f"{run_label(cands[0])} {mean_y:.4g} ± {sd(ys, mean_y):.2g} (mean ± sd over seeds); "
                f"difference {difference:.3g}{u} (absolute floor {floor:.3g}{u})",
                mode="seed statistics",
                absolute=difference,
                unit=unit,
            )
        )
    return rows


def equivalence(
    xs: Sequence[float], ys: Sequence[float], margin: float, alpha: float = 0.05
) -> tuple[bool | None, float, float]:
    """Two one-sided tests (Welch) of ``|mean(ys) - mean(xs)| < margin`` at level `alpha`.

    Returns ``(decision, low, high)``: the ``1 - 2 alpha`` confidence interval of
    ``mean(ys) - mean(xs)``, and True (inside the margin: equivalent), False (wholly outside:
    different) or None (undecided: more seeds).

    Example:
      >>> equivalence([1.0, 1.01, 0.99], [1.0, 1.02, 0.98], margin=0.1)[0]
      True
    """
    x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    if x.std() == 0 and y.std() == 0:
        low = high = float(y.mean() - x.mean())
    else:
        from scipy import stats

        interval = stats.ttest_ind(y, x, equal_var=False).confidence_interval(1 - 2 * alpha)
        low, high = float(interval.low), float(interval.high)
    if -margin < low and high < margin:
        return True, low, high
    if low >= margin or high <= -margin:
        return False, low, high
    return None, low, high


def seeds_needed(xs, ys, margin, alpha=0.05) -> int:
    """Seeds per framework at which the observed spread and difference would decide."""
    spread = max(float(np.std(xs, ddof=1)), float(np.std(ys, ddof=1)), 1e-12)
    room = abs(margin - abs(float(np.mean(ys) - np.mean(xs))))
    from scipy import stats

    z = stats.norm.ppf(1 - alpha)
    return max(len(xs) + 1, math.ceil(2 * (z * spread / max(room, 1e-12)) ** 2))


def seed_equivalence(pair) -> list[Row]:
    """Final loss and eval metric over the seeds: equivalent within the margin (TOST)."""
    refs, cands = pair.seed_refs, pair.seed_cands
    alpha = TOLERANCES["seed_alpha"]
    rows = []
    for series, label, get, metric in _seed_series(refs):
        xs, ys = [get(r) for r in refs], [get(r) for r in cands]
        if any(v is None for v in xs + ys):
            continue  # the Welch row says which value is missing
        if metric == "accuracy":
            margin, relative = TOLERANCES["seed_margin_accuracy"], None
        else:
            scale = abs(float(np.mean(xs))) or 1.0
            relative = TOLERANCES["seed_margin_loss"]
            margin = relative * scale
        decision, low, high = equivalence(xs, ys, margin, alpha)
        unit = "" if metric == "accuracy" else f" {LOSS_UNIT}"
        detail = (
            f"TOST (two one-sided Welch tests, alpha {alpha:.0%}): the {1 - 2 * alpha:.0%} interval "
            f"of the difference is [{low:.3g}, {high:.3g}]{unit} against the margin +-{margin:.3g}{unit}"
            + (f" ({relative:.0%} of the torch mean)" if relative is not None else " (absolute)")
            + f"; torch {np.mean(xs):.4g}, jax {np.mean(ys):.4g} over {len(xs)} seeds"
        )
        needed = None
        if decision is None:
            needed = seeds_needed(xs, ys, margin, alpha)
            detail += (
                f"; undecided: about {needed} seeds per framework would decide at this spread "
                "(--seeds N)"
            )
        elif decision is False:
            detail += "; the frameworks differ by more than the margin"
        rows.append(
            Row(
                f"equivalence {series}",
                f"{label} over seeds (equivalence)",
                max(abs(low), abs(high)),
                f"+-{margin:.3g}{unit}"
                + (f" ({relative:.0%} of torch's mean)" if relative is not None else ""),
                decision,
                detail,
                mode="seed statistics" if decision is not None else "inconclusive",
                absolute=abs(float(np.mean(ys) - np.mean(xs))),
                unit=unit.strip(),
                power=relative if relative is not None else margin,
                seeds_needed=needed,
                late=True,
            )
        )
    return rows


def structural(pair) -> list[Row]:
    """Informational rows naming a structural difference between the two models (a weight
    mapping that folds trainable tensors, embedding padding rows torch never trains)."""
    return [
        Row(
            "structural",
            s.check,
            s.value,
            "—",
            None,
            f"{s.reason}. {s.note}",
            mode="informational",
            late=True,
        )
        for s in pair.structural
    ]
