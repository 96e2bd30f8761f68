"""Verdicts with power: what `parity.verdicts.compare`'s rows could have detected, and what decides
where they could not.

`judge(runs, verdicts)` takes `parity.verdicts.compare.compare_runs`'s rows and the run records and
returns the rows the outputs are written from:

- **Every step judged.** An fp32 run longer than the fixed bands' 30 steps gets a row for the
  steps after them, at the last band (1e-3), when no calibrated row covers them.
- **The horizon.** A noise-calibrated per-step row whose tolerance climbs above the loss bound
  (`parity.verdicts.rows.POWER_BOUNDS`: 20%) is split: the steps up to the horizon (tolerance
  within the bound) decide; the steps after it are inconclusive, never a pass. The tolerance of
  each step is `step_tolerances` (the calibrated formula of `parity.verdicts.compare`).
- **Seed statistics as an equivalence test.** With K >= 2 data seeds per framework, final loss
  and the eval metric are decided by a two one-sided tests procedure (TOST, Welch's t,
  ``alpha = 5%``): PASS when the 90% confidence interval of the difference lies within the
  margin (`SEED_MARGINS`), FAIL when it lies wholly outside, else INCONCLUSIVE with the number
  of seeds that would decide. Welch's test of a difference stays as an informational row: not
  rejecting "equal means" with three seeds proves nothing.
- **A departure from the rounding floor** (`_rounding_departure`): in a calibrated fp32 pair whose
  loss gap stayed within ``k`` times the model's own self-divergence for at least one step past
  step 0 and then left it, failing trajectory rows from that step on are inconclusive: the two
  steps agreed to float32 rounding, and only a threshold that rounding crosses (a ReLU input
  near 0, whose gradient jump AdamW scales per element) parts runs that agree that closely. The
  1-ulp noise run does not date such a crossing: it perturbs the weights once, where another
  framework's arithmetic differs at every step. Seed statistics decide (``--seeds N``, N from
  `parity.verdicts.rows.seeds_to_decide`, as in the cell's deciding command). A gap
  above that floor from step 1 on still fails.
- **Structural differences**: where the run records' weight mapping folds trainable tensors
  (`parity.automap`), failing rows past step 0 are inconclusive, saying why (`_structural`).
- **Gradient norm and update norm** (run records' ``grad_norm`` / ``update_norm`` per step,
  `parity.training.steps`): judged step by step like the loss, at `SIGNAL_FACTOR` times the
  loss tolerance of the step, up to the same horizon; an fp16 run's largest |scaled gradient|
  per parameter names, where skip decisions differ, the parameter that overflowed on each side
  (`parity.verdicts.fp16`), or an intermediate where no parameter (or every one) overflowed. After a
  rounding flip the comparison goes on with the scales realigned (`fp16_realigned_rows`):
  every later differing skip must be explained by the two scales, and each side's scale must
  follow its own skips by GradScaler's rule.

Rows are `parity.verdicts.rows.Verdict`; a row that would pass with a tolerance above its bound
is made inconclusive where it is built (``Verdict.__post_init__``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats

from parity.core.recipes import get_recipe
from parity.core.records import (
    comparable_labels,
    config_differences,
    run_label,
    run_seed,
    run_status,
)
from parity.verdicts.fp16 import explained_steps, fp16_realigned_rows, fp16_skip_rows
from parity.verdicts.rows import (
    LOSS_UNIT,
    PADDING_CHECK,
    POWER_BOUNDS,
    TOLERANCES,
    Verdict,
    final_mean,
    fmt_value,
    loss_floor,
    pair_fields,
    relative_gaps,
    run_losses,
    seeds_to_decide,
    self_divergence,
    signal_envelope,
    signal_gaps,
)

__all__ = [
    "SEED_MARGINS",
    "SIGNAL_FACTOR",
    "equivalence",
    "judge",
    "envelope_ratio",
    "step_band",
    "step_tolerances",
]

# Equivalence margins of the seed statistics: final loss relative to the torch mean (the
# final-loss band a single run is held to), accuracy absolute (2 points: what 5 seeds of the
# built-in models' synthetic sets resolve; a port that loses 2 points is not equivalent).
SEED_MARGINS = {"loss": TOLERANCES["final_loss_rel"], "accuracy": 0.02}

# Gradient and update norms move with the loss but amplify rounding more (a norm over every
# parameter's gradient, each a difference of large terms under BatchNorm): they are held to
# this many times the loss tolerance of the same step.
SIGNAL_FACTOR = 10.0


_STEPS = re.compile(r"^per-step loss, steps (\d+)-(\d+)$")


def step_band(step: int) -> float:
    """The fixed per-step loss band of `step` (1e-4 for steps 0-9, 1e-3 after).

    Example:
      >>> step_band(0), step_band(10)
      (0.0001, 0.001)
    """
    first_stop, first_tol = TOLERANCES["fp32_first"]
    return first_tol if step < first_stop else TOLERANCES["fp32_next"][1]


def envelope_ratio(gaps: Sequence[float], envelope: Sequence[float] | None) -> float:
    """How much `step_tolerances` scales a self-divergence `envelope` up: the step-0 gap over the
    envelope's first value (its floor at least), when that gap is within step 0's band; else 1.

    Example:
      >>> envelope_ratio([2e-5, 0.0], [1e-5, 1e-4])
      2.0
    """
    if not envelope or not gaps:
        return 1.0
    step0 = gaps[0]
    if not math.isfinite(step0) or step0 > step_band(0):
        return 1.0
    return max(1.0, step0 / max(envelope[0], TOLERANCES["noise_floor"]))


def step_tolerances(gaps: Sequence[float], envelope: Sequence[float] | None) -> list[float]:
    """The per-step loss tolerance of `parity.verdicts.compare`'s trajectory rows: the fixed band of each
    step, or with a self-divergence `envelope` ``max(band(s), k * min(r * env(s + lag),
    max env))`` from step 1 on (``r`` rescales the envelope to the step-0 gap).

    Example:
      >>> step_tolerances([0.0, 0.0], None)
      [0.0001, 0.0001]
    """
    out = []
    k, lag = TOLERANCES["noise_k"], TOLERANCES["noise_lag"]
    ratio = envelope_ratio(gaps, envelope)
    saturation = max((e for e in envelope or () if math.isfinite(e)), default=0.0)
    for s in range(len(gaps)):
        noise = 0.0
        if envelope and s > 0:
            noise = k * min(ratio * envelope[min(s + lag, len(envelope) - 1)], saturation)
        out.append(max(step_band(s), noise))
    return out


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
        interval = stats.ttest_ind(y, x, equal_var=False).confidence_interval(1 - 2 * alpha)
        low, high = float(interval.low), float(interval.high)
    if -margin < low and high < margin:
        return True, low, high
    if low >= margin or high <= -margin:
        return False, low, high
    return None, low, high


def _seeds_needed(xs, ys, margin, alpha=0.05) -> int:
    """Seeds per framework at which the observed spread and difference would decide."""
    spread = max(float(np.std(xs, ddof=1)), float(np.std(ys, ddof=1)), 1e-12)
    room = abs(margin - abs(float(np.mean(ys) - np.mean(xs))))
    z = stats.norm.ppf(1 - alpha)
    return max(len(xs) + 1, math.ceil(2 * (z * spread / max(room, 1e-12)) ** 2))


def _pairs(runs):
    """(cell, ref, cand, noise runs, mains, seed groups) as `parity.verdicts.compare` pairs them."""
    groups: dict[tuple, list] = {}
    for run in runs:
        if run_status(run) in ("unsupported", "error"):
            continue
        groups.setdefault((run["model"], run["precision"], run["device"]), []).append(run)
    for cell, members in sorted(groups.items()):
        main = [r for r in members if not r.get("variant")]
        for label, jax_label in comparable_labels(main):
            refs = [r for r in main if run_label(r) == label]
            jax_main = [r for r in main if run_label(r) == jax_label]
            seeds = sorted({run_seed(r) for r in refs} & {run_seed(r) for r in jax_main})
            if not seeds:
                continue
            seed = seeds[0]
            ref = next(r for r in refs if run_seed(r) == seed)
            cand = next(r for r in jax_main if run_seed(r) == seed)
            if config_differences(ref, cand):  # not comparable: compare's row names the fields
                continue
            mains = {"torch": ref, "jax": cand}
            # Calibration and seed runs made with other settings are left out, as compare does.
            noise = [
                r
                for r in members
                if r.get("variant") == "noise"
                and run_seed(r) == seed
                and not config_differences(mains[r["framework"]], r)
            ]
            pairs = [
                (
                    next(r for r in refs if run_seed(r) == s),
                    next(r for r in jax_main if run_seed(r) == s),
                )
                for s in seeds
            ]
            pairs = [
                (a, b)
                for a, b in pairs
                if not (config_differences(ref, a) or config_differences(cand, b))
            ]
            by_seed = ([a for a, _ in pairs], [b for _, b in pairs])
            yield cell, ref, cand, noise, mains, by_seed


def _envelope(noise, mains):
    envelope = None
    for run in noise:
        main = mains.get(run["framework"])
        env = self_divergence(main, [run]) if main is not None else None
        if env is None:
            continue
        envelope = (
            env if envelope is None else [max(a, b) for a, b in zip(envelope, env, strict=False)]
        )
    return envelope


def _window_row(base, check, gaps, tolerances, start, stop, bound, what, calibrated=False):
    """A per-step row over steps [start, stop): decisive where every tolerance is within
    `bound`; otherwise the caller splits at the horizon first."""
    segment = gaps[start:stop]
    tols = tolerances[start:stop]
    failing = [start + i for i, (g, t) in enumerate(zip(segment, tols, strict=False)) if not g <= t]
    worst = max(range(len(segment)), key=lambda i: (segment[i] / tols[i], segment[i]))
    judge_i = failing[0] - start if failing else worst
    return Verdict(
        check=check,
        value=segment[judge_i],
        tolerance=max(tols),
        passed=not failing,
        detail=(
            f"{what}: "
            + (
                f"first failing step {failing[0]} ({len(failing)} of {stop - start} fail); "
                if failing
                else "no step fails; "
            )
            + f"worst step {start + worst}: {fmt_value(segment[worst])} relative against "
            f"{fmt_value(tols[worst])}; could detect a relative difference of "
            f"{fmt_value(min(tols))} at its most sensitive step, {fmt_value(max(tols))} at every "
            f"step (bound {fmt_value(bound)})"
        ),
        mode="noise-calibrated" if calibrated else "fixed bands",
        first_failing_step=failing[0] if failing else None,
        worst_step=start + worst,
        power=max(tols),
        **base,
    )


def _beyond_row(base, check, gaps, tolerances, start, stop, bound, what) -> Verdict:
    segment, tols = gaps[start:stop], tolerances[start:stop]
    failing = [start + i for i, (g, t) in enumerate(zip(segment, tols, strict=False)) if not g <= t]
    return Verdict(
        check=check,
        value=max(segment),
        tolerance=max(tols),
        passed=False if failing else None,
        detail=(
            f"{what} beyond the horizon: the model's own divergence makes the tolerance "
            f"{fmt_value(min(tols))}-{fmt_value(max(tols))}, above the bound {fmt_value(bound)}"
            + (
                f"; yet step {failing[0]} exceeds even that"
                if failing
                else ": these steps could not have failed a port bug and decide nothing "
                "(inconclusive; seed statistics decide: --seeds)"
            )
        ),
        mode="noise-calibrated" if failing else "inconclusive",
        first_failing_step=failing[0] if failing else None,
        power=max(tols),
        **base,
    )


# AdamW divides each element's moment by its own magnitude: an element whose gradient is zero in
# exact arithmetic but rounding noise in floats (a bias before a BatchNorm, a padded row) moves by
# up to lr * |g| / (|g| + eps) either way, so the update norm measures rounding there, not the port.
ADAPTIVE_UPDATE_NOTE = (
    "informational under AdamW: each element's step is its gradient over its own magnitude, so "
    "parameters whose exact gradient is zero (a bias before BatchNorm) move by rounding noise "
    "and set the update norm; judged under SGD"
)


def _adaptive(run) -> bool:
    return (run.get("config") or {}).get("optimizer", "adamw") != "sgd"


def _informational(verdict: Verdict, note: str) -> Verdict:
    return dataclasses.replace(
        verdict,
        passed=None,
        mode="informational",
        detail=f"{verdict.detail}; {note}" if verdict.detail else note,
    )


# Past the fixed bands' windows (steps 0-29) float32 rounding differences grow with the model's
# own chaotic amplification: a fixed band there, uncalibrated, cannot tell that growth from a port
# bug, so its failure is inconclusive (decided by --noise torch or seed statistics), never a FAIL.
CHAOS_STEP = TOLERANCES["fp32_next"][0]
UNCALIBRATED_NOTE = (
    f"inconclusive, not failed: from step {CHAOS_STEP} on, no band is calibrated to this "
    "model's own float32 divergence (a correct port's gap grows by chaotic amplification); "
    "decide with --noise torch (self-divergence) or seed statistics (equivalence: the seeds "
    "the cell's deciding command names)"
)


def _split_trajectory(
    base, prefix, gaps, tolerances, start, stop, bound, what, calibrated=False
) -> list[Verdict]:
    """`_trajectory`, with the uncalibrated steps from `CHAOS_STEP` on in rows of their own
    whose failures are inconclusive (`UNCALIBRATED_NOTE`)."""
    if calibrated or stop <= CHAOS_STEP:
        return _trajectory(base, prefix, gaps, tolerances, start, stop, bound, what, calibrated)
    split = max(start, CHAOS_STEP)
    head = _trajectory(base, prefix, gaps, tolerances, start, split, bound, what, calibrated)
    tail = _trajectory(base, prefix, gaps, tolerances, split, stop, bound, what, calibrated)
    tail = [
        dataclasses.replace(
            v,
            passed=None,
            mode="inconclusive",
            detail=f"{v.detail}; {UNCALIBRATED_NOTE}" if v.detail else UNCALIBRATED_NOTE,
        )
        if v.passed is False
        else v
        for v in tail
    ]
    return head + tail


def _trajectory(
    base, prefix, gaps, tolerances, start, stop, bound, what, calibrated=False
) -> list[Verdict]:
    """Rows for steps [start, stop): split at the horizon (the last step whose tolerance is
    within `bound`, counting from `start`)."""
    if start >= stop:
        return []
    horizon = start
    while horizon < stop and tolerances[horizon] <= bound:
        horizon += 1
    rows = []
    if horizon > start:
        label = f"{prefix}, steps {start}-{horizon - 1}"
        if horizon < stop:
            label += " (horizon)"
        row = _window_row(base, label, gaps, tolerances, start, horizon, bound, what, calibrated)
        if horizon == 1:  # step 0 alone: the gate's business, never what makes a PASS
            row = dataclasses.replace(row, mode="step 0")
        rows.append(row)
    if horizon < stop:
        rows.append(
            _beyond_row(
                base,
                f"{prefix}, steps {horizon}-{stop - 1} (beyond the horizon)",
                gaps,
                tolerances,
                horizon,
                stop,
                bound,
                what,
            )
        )
    return rows


def _is_fp32(run) -> bool:
    try:
        return get_recipe(run["precision"]).compute_dtype_name == "float32"
    except ValueError:
        return "c=f32" in (run.get("policy") or "")


def _trajectory_rows(verdicts, ref, cand, noise, mains, skipped_apart=()):
    """New per-step rows for one pair; the names of compare's rows they replace; the power
    (largest tolerance) of compare's per-step rows that stay. Steps in `skipped_apart` (fp16
    skip decisions that differ, explained by `parity.verdicts.fp16.explained_steps`) are left to
    the fp16 rows in the per-step signal rows: one side's gradients are non-finite there by
    design."""
    base = pair_fields(ref, cand)
    bound = POWER_BOUNDS["loss"]
    ref_l, cand_l = run_losses(ref), run_losses(cand)
    gaps = relative_gaps(ref_l, cand_l, loss_floor(ref_l))
    n = len(gaps)
    envelope = _envelope(noise, mains)
    tolerances = step_tolerances(gaps, envelope)
    calibrated = envelope is not None
    mine = [
        v
        for v in verdicts
        if v.cell == (base["model"], base["precision"], base["device"])
        and v.compared == base["compared"]
    ]
    rows: list[Verdict] = []
    replaced: set[str] = set()
    powered: dict[str, float] = {}
    covered = -1
    if _is_fp32(ref) and n:
        for v in mine:
            match = _STEPS.match(v.check)
            if not match:
                continue
            start, stop = int(match.group(1)), int(match.group(2)) + 1
            covered = max(covered, stop - 1)
            power = max(tolerances[start:stop], default=None)
            if v.passed is True and power is not None and power > bound:
                replaced.add(v.check)
                rows += _trajectory(
                    base, "per-step loss", gaps, tolerances, start, stop, bound, "loss", calibrated
                )
            elif v.power is None and power is not None:
                powered[v.check] = power
        if covered < n - 1:
            rows += _split_trajectory(
                base, "per-step loss", gaps, tolerances, covered + 1, n, bound, "loss", calibrated
            )
    for field, name in (("grad_norm", "gradient norm"), ("update_norm", "update norm")):
        signal = signal_gaps(ref, cand, field)
        if signal is None or not n:
            continue
        signal = [0.0 if s in skipped_apart else g for s, g in enumerate(signal)]
        m = min(len(signal), n)
        own = None
        if _is_fp32(ref):
            tols = [SIGNAL_FACTOR * t for t in tolerances[:m]]
            own = signal_envelope(noise, mains, field)
            if own:  # the signal's own rounding divergence, where it outruns the loss's
                own_tols = step_tolerances(signal[:m], own)
                tols = [max(t, o) for t, o in zip(tols, own_tols, strict=False)]
        else:  # mixed precision: the final-loss band per step, as a rounding-level check
            tols = [SIGNAL_FACTOR * TOLERANCES["final_loss_rel"]] * m
        signal_rows = _split_trajectory(
            base,
            f"per-step {name}",
            signal[:m],
            tols,
            0,
            m,
            POWER_BOUNDS["norm"],
            f"{name} (unscaled, before clipping; {SIGNAL_FACTOR:g} x the loss tolerance"
            + (", or its own noise-calibrated tolerance where larger)" if own else ")")
            if field == "grad_norm"
            else f"{name} (||params after - params before||)",
            calibrated and _is_fp32(ref),
        )
        if field == "update_norm" and _adaptive(ref):
            signal_rows = [_informational(v, ADAPTIVE_UPDATE_NOTE) for v in signal_rows]
        rows += signal_rows
    return rows, replaced, powered


def _seed_rows(cell, refs, cands) -> list[Verdict]:
    base = {
        "model": cell[0],
        "precision": cell[1],
        "device": cell[2],
        "compared": f"{run_label(cands[0])} vs {run_label(refs[0])}, "
        f"{len(refs)}+{len(cands)} seeds",
    }
    window = TOLERANCES["final_window"]
    name = refs[0]["summary"].get("eval_metric_name", "metric")
    rows = []
    for label, get, kind in (
        ("final loss", lambda r: final_mean(run_losses(r), window), "loss"),
        (f"eval {name}", lambda r: r["summary"].get("eval_metric"), name),
    ):
        xs, ys = [get(r) for r in refs], [get(r) for r in cands]
        if any(v is None for v in xs + ys):
            continue  # compare's Welch row already says which value is missing
        if kind == "accuracy":
            margin, relative = SEED_MARGINS["accuracy"], None
        else:
            scale = abs(float(np.mean(xs))) or 1.0
            relative = SEED_MARGINS["loss"]
            margin = relative * scale
        decision, low, high = equivalence(xs, ys, margin)
        unit = "" if kind == "accuracy" else f" {LOSS_UNIT}"
        detail = (
            f"TOST (two one-sided Welch tests, alpha 5%): the 90% interval of the difference "
            f"is [{low:.3g}, {high:.3g}]{unit} against the margin +-{margin:.3g}{unit}"
            + (f" ({relative:.0%} of the torch mean)" if relative is not None else " (absolute)")
            + f"; torch {np.mean(xs):.4g}, jax {np.mean(ys):.4g} over {len(xs)} seeds"
        )
        if decision is None:
            detail += (
                f"; undecided: about {_seeds_needed(xs, ys, margin)} seeds per framework "
                "would decide at this spread (--seeds N)"
            )
        elif decision is False:
            detail += "; the frameworks differ by more than the margin"
        rows.append(
            Verdict(
                check=f"{label} over seeds (equivalence)",
                value=max(abs(low), abs(high)),
                tolerance=f"+-{margin:.3g}{unit}"
                + (f" ({relative:.0%} of torch's mean)" if relative is not None else ""),
                passed=decision,
                detail=detail,
                mode="seed statistics" if decision is not None else "inconclusive",
                absolute=abs(float(np.mean(ys) - np.mean(xs))),
                unit=unit.strip(),
                power=relative if relative is not None else margin,
                **base,
            )
        )
    return rows


# Measured on the built-in resnet at lr 1e-2 (AdamW, batch 8, 20 steps), a correct port: loss gap
# 1e-7, 2e-7, then 3e-5 at step 2 and 2.9% at step 14, while torch's 1-ulp noise run stayed
# within 2.3e-7. At torch's own parameters the JAX gradients agree to 4e-6 of each tensor's
# largest, and optax's AdamW step agrees with torch's to 5e-7 given the same gradients. torch
# itself, run from JAX's step-2 parameters (5e-7 away), reproduces JAX's gradient jump: one
# ReLU input of blocks.0.bn1 sat 1e-6 from zero. torch with gradient noise of 4-16 float32 ulps
# per step parts from itself the same way (3e-4 to 1e-2 by step 14) in 3 of 4 seeds.
DEPARTURE_NOTE = (
    "inconclusive, not failed: the loss gap stayed within {k:g} x the model's own rounding "
    "divergence through step {last} and left it at step {step} ({gap} against {floor}); runs "
    "that agree to float32 rounding part only where rounding crosses a threshold (a ReLU input "
    "near 0, whose gradient jump AdamW scales per element), which a 1-ulp noise run does not "
    "date; decide with --seeds {seeds} (equivalence)"
)


def _departure(
    gaps: Sequence[float], envelope: Sequence[float] | None, seeds: int
) -> tuple[int, str] | None:
    """``(step, note)`` where a calibrated loss gap left the rounding floor (``k`` times the
    self-divergence envelope, at least ``k`` float32 half-ulps) after agreeing to it for at
    least one step past step 0; None when it never agreed past step 0 or never left it. The
    note asks for `seeds` data seeds (`seeds_to_decide` of the cell's rows: the number its
    deciding command asks for)."""
    if not envelope or len(gaps) < 3:
        return None
    k = TOLERANCES["noise_k"]

    def floor(s):
        level = envelope[min(s, len(envelope) - 1)]
        return k * max(level if math.isfinite(level) else math.inf, TOLERANCES["noise_floor"])

    step = next((s for s in range(1, len(gaps)) if not gaps[s] <= floor(s)), None)
    if step is None or step < 2:
        return None
    note = DEPARTURE_NOTE.format(
        k=k,
        last=step - 1,
        step=step,
        gap=fmt_value(gaps[step]),
        floor=fmt_value(floor(step)),
        seeds=seeds,
    )
    return step, note


def _rounding_departure(out, new, cell, compared, ref, cand, noise, mains) -> list[Verdict]:
    """Failing fp32 trajectory rows (per-step loss and gradient norm, final loss) of a pair
    whose loss gap departed from the rounding floor (`_departure`) at or before their first
    failing step become inconclusive, saying why; `new` is changed in place."""
    if not _is_fp32(ref):
        return out
    envelope = _envelope(noise, mains)
    ref_l, cand_l = run_losses(ref), run_losses(cand)
    # the seeds the note asks for are those the cell's deciding command asks for (the
    # cell's rows so far: its undecided equivalence rows say how many their spread needs)
    seeds = seeds_to_decide([v for v in (*out, *new) if v.cell == cell])
    found = _departure(relative_gaps(ref_l, cand_l, loss_floor(ref_l)), envelope, seeds)
    if found is None:
        return out
    step, note = found

    def soften(v: Verdict) -> Verdict:
        trajectory = v.check.startswith(("per-step loss", "per-step gradient norm", "final loss"))
        late = v.first_failing_step is None or v.first_failing_step >= step
        if v.passed is False and trajectory and late and "over seeds" not in v.check:
            return dataclasses.replace(
                v, passed=None, mode="inconclusive", detail=f"{v.detail}; {note}"
            )
        return v

    new[:] = [soften(v) for v in new]
    return [soften(v) if v.cell == cell and v.compared == compared else v for v in out]


def _folded(run) -> list[dict[str, Any]]:
    rows = run.get("weight_mapping") or []
    return [r for r in rows if isinstance(r, Mapping) and "folded" in str(r.get("note", ""))]


def _padding(run) -> Mapping[str, Any] | None:
    for row in (run.get("step0") or {}).get("verdicts") or []:
        if isinstance(row, Mapping) and row.get("check") == PADDING_CHECK:
            return row
    return None


def _structural(out, new, cell, compared, ref, cand) -> list[Verdict]:
    """Where the weight mapping folds trainable tensors (torch's b_ih + b_hh summed into one
    Flax bias), or torch never trains an embedding row the Flax model trains (``padding_idx``,
    named by step 0), the two models are different models from step 1 on: a trajectory that
    parts says nothing about the port. Its failing rows past step 0 become inconclusive, saying
    why, and a row names the difference; step 0 (same weights on both sides) still decides.
    `new` (this pair's rows from `judge`) is changed in place."""
    folded = _folded(ref) or _folded(cand)
    padding = _padding(ref) or _padding(cand)
    reasons, rows = [], []
    if folded:
        names = ", ".join(str(r.get("torch")) for r in folded)
        reason = (
            f"the weight mapping folds trainable tensors ({names}): the Flax model trains one "
            "tensor where torch trains several, so the trajectories part by construction; past "
            "step 0 this row cannot tell that from a port bug (step 0 decides)"
        )
        reasons.append(reason)
        rows.append(
            (
                "structural difference (weight mapping)",
                f"{len(folded)} folded",
                f"{reason}. {folded[0].get('note', '')}",
            )
        )
    if padding is not None:
        reason = (
            f"torch never trains its embeddings' padding rows ({padding.get('value')}; "
            "nn.Embedding(padding_idx=...)), the Flax Embed trains them: past step 0 the models "
            "train differently wherever a batch holds that token, and this row cannot tell that "
            "from a port bug (step 0 decides)"
        )
        reasons.append(reason)
        rows.append(
            (
                "structural difference (embedding padding rows)",
                str(padding.get("value")),
                f"{reason}. {padding.get('detail', '')}",
            )
        )
    if not reasons:
        return out
    reason = "; ".join(reasons)

    def soften(v: Verdict) -> Verdict:
        past_step0 = v.check.startswith(("per-step", "final loss")) and (
            v.first_failing_step is None or v.first_failing_step > 0
        )
        if v.passed is False and past_step0:
            return dataclasses.replace(
                v, passed=None, mode="inconclusive", detail=f"{v.detail}; {reason}"
            )
        return v

    new[:] = [soften(v) for v in new]
    for check, value, detail in rows:
        new.append(
            Verdict(
                check=check,
                value=value,
                tolerance="—",
                passed=None,
                detail=detail,
                mode="informational",
                **pair_fields(ref, cand),
            )
        )
    return [soften(v) if v.cell == cell and v.compared.startswith(compared) else v for v in out]


def judge(runs: Sequence[Mapping[str, Any]], verdicts: Sequence[Verdict]) -> list[Verdict]:
    """`parity.verdicts.compare.compare_runs`'s rows with power: the horizon split, every step covered,
    seed equivalence, gradient/update norms and fp16 skip explanations (module docstring).

    Example:
      >>> judge([], [])
      []
    """
    out = list(verdicts)
    for cell, ref, cand, noise, mains, (refs, cands) in _pairs(runs):
        if ref["summary"].get("error") or cand["summary"].get("error"):
            continue
        calibration = [(mains[r["framework"]], r) for r in noise]
        skip_rows = fp16_skip_rows(ref, cand, calibration)
        # a differing skip within `flip_window` of float16's max (a flip): the scales part there
        flip = (
            skip_rows[0].first_failing_step
            if skip_rows and skip_rows[0].mode == "informational"
            else None
        )
        skipped_apart = [] if flip is None else explained_steps(ref, cand, flip, calibration)
        new, replaced, powered = _trajectory_rows(out, ref, cand, noise, mains, skipped_apart)
        compared = f"{run_label(cand)} vs {run_label(ref)}"
        out = [
            dataclasses.replace(v, power=powered[v.check])
            if v.cell == cell and v.compared == compared and v.check in powered
            else v
            for v in out
        ]
        if len(refs) >= 2:
            seed_compared = f"{compared}, {len(refs)}+{len(cands)} seeds"
            out = [
                dataclasses.replace(
                    v,
                    passed=None,
                    mode="informational",
                    detail=v.detail + "; a difference test that does not reject proves "
                    "nothing: the equivalence row decides",
                )
                if v.cell == cell and v.compared == seed_compared and "Welch" in v.check
                else v
                for v in out
            ]
            new += _seed_rows(cell, refs, cands)
        new += skip_rows
        if flip is not None:
            new += fp16_realigned_rows(ref, cand, flip, calibration)
            out = [
                dataclasses.replace(
                    v,
                    passed=None,
                    mode="informational",
                    detail=f"{v.detail}; explained: a rounding flip at step {flip} (both sides "
                    "within the flip window of float16's max: its fp16 skip row); the scales "
                    "part there, and the rows after the flip (scales realigned) decide",
                )
                if v.cell == cell
                and v.compared == compared
                and v.check in ("loss-scale trajectory", "skip decisions")
                # the skip is at the flip; the scales it used part from the next step
                and v.first_failing_step in (flip, flip + 1)
                else v
                for v in out
            ]
        out = _structural(out, new, cell, compared, ref, cand)
        out = _rounding_departure(out, new, cell, compared, ref, cand, noise, mains)
        kept = [
            v
            for v in out
            if not (v.cell == cell and v.compared == compared and v.check in replaced)
        ]
        # New rows go after the pair's last row.
        last = max(
            (i for i, v in enumerate(kept) if v.cell == cell and v.compared.startswith(compared)),
            default=len(kept) - 1,
        )
        out = kept[: last + 1] + new + kept[last + 1 :]
    return out
