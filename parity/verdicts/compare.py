"""Tolerances and verdicts: does the JAX run train like the torch run?

For every (model, precision, device) cell with a torch run and a JAX run (each torch mode, eager
and torch.compile, is compared with JAX separately), on the main data seed:

- ``comparable configs`` first: the two runs must agree on every setting that shapes the
  trajectory (`parity.core.records.TRAJECTORY_FIELDS`: steps, batch size, seed, data, architecture overrides,
  optimizer and its hyperparameters, learning rate and schedule, clipping; the loss-scale
  settings where the recipe scales the loss) and record the same number of steps (unless one
  stopped early on a non-finite loss, which fails ``no divergence``). Otherwise the cell is
  **not comparable**: one row naming each differing field with both values, nothing judged,
  never a pass (alone, ``compare`` exits 3 as for "nothing compared"). Calibration and seed
  runs that differ from their main run are left out, with a row saying so.

- ``no divergence`` (all precisions): neither run has a non-finite loss. A run that raised fails
  ``run completed``; a cell this hardware cannot run is reported ``unsupported here`` (never a
  failure, never a pass).
- **per-step loss** (fp32): the relative gap ``|L_jax - L_torch| / max(|L_torch|, 1% of the
  first torch loss)`` (the floor keeps losses trained to ~0 from producing meaningless 100%
  gaps) must stay within the **fixed bands**: 1e-4 for steps 0-9, 1e-3 for steps 10-29.
  **Noise-calibrated mode**, when calibration runs (``variant="noise"``: the same framework
  started from weights nudged by one ulp, see `parity.verdicts.calibrate`) are present: the model's own
  amplification of rounding is measured as the self-divergence envelope ``env(s)`` (the running
  maximum of the perturbed-vs-unperturbed gap up to step ``s``, over every calibration pair).
  Chaotic divergence grows in proportion to the initial difference until it saturates, so the
  envelope is rescaled to the cross-framework step-0 gap, ``r = max(1, gap(0) / max(env(0),
  2**-24))``, and capped at its own saturation level: from step 1 on, the tolerance is
  ``max(band(s), k * min(r * env(s + 2), max env))`` with ``k = 10``, over every step of the run
  (band 1e-3 after step 29). The envelope is read 2 steps ahead: rounding matters where it
  crosses a threshold (the sign of a near-zero gradient component under AdamW, a ReLU, a max),
  and a one-ulp nudge crosses those a step or two later than the larger cross-framework
  rounding differences do (measured on the ResNet pair: gap 3e-3 at step 1, self-divergence
  5e-3 at step 2). Step 0 is always judged by its fixed band: both sides hold the same
  weights there, so a wrong port fails at step 0 whatever the chaos. Where the envelope never
  exceeds the bands (the built-in models) the fixed bands decide; the row says which mode did.
- ``fp16-mixed``: identical loss-scale trajectory and identical skip decisions, step for step. A
  trajectory without a scale event (no skip, no growth) tested nothing: those rows are
  informational, never a pass (use the fp16 stress setting, `parity.core.config.FP16_STRESS`).
- **final loss** (mixed and bf16-true precisions): the mean of the last 5 losses within 5%
  relative (same floor as above). With calibration runs the tolerance is at least ``k`` times
  the envelope there. With K > 1 data seeds per framework (`parity.verdicts.calibrate.seed_runs`),
  **seed statistics** decide instead: final loss and eval metric are compared across frameworks
  with Welch's two-sample t-test (two-sided, 95% confidence); the difference passes when the
  test does not reject equal means or when it is below the absolute floor (1% of the first loss
  for losses, 0.01 for accuracy).
- informational: max per-step relative gap over the whole run, eval metric difference.

Step-0 checks (`parity.verdicts.step0`) plug in as extra `Verdict` rows: pass them to `compare_runs`
(``extra_verdicts=``) or store ``run["step0"] = Step0Result.to_dict()`` in a run record; both
appear in the verdict table and the report (``parity.report.markdown`` renders ``step0.diagnosis``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from parity.core.recipes import get_recipe
from parity.core.records import (
    comparable_labels,
    config_differences,
    run_label,
    run_seed,
    run_status,
)
from parity.verdicts.logits import logit_rows
from parity.verdicts.power import envelope_ratio, step_band, step_tolerances
from parity.verdicts.rows import (
    LOSS_UNIT,
    TOLERANCES,
    Verdict,
    final_mean,
    fmt_value,
    loss_floor,
    relative_gaps,
    run_losses,
    self_divergence,
)

__all__ = ["compare_runs"]


# --- comparability -----------------------------------------------------------------------------


def _not_comparable(ref, cand, differences: list[str]) -> Verdict:
    return Verdict(
        ref["model"],
        ref["precision"],
        ref["device"],
        check="comparable configs",
        compared=f"{run_label(cand)} vs {run_label(ref)}",
        value="differ: " + "; ".join(differences),
        tolerance="the same trajectory settings",
        passed=None,
        detail="not comparable: the runs differ in settings that shape the trajectory, so their "
        "gap would measure the settings, not the port; rerun one side with the other's settings "
        "(nothing judged, never a pass)",
        mode="not comparable",
    )


def _left_out(ref, run, differences: list[str]) -> Verdict:
    return Verdict(
        ref["model"],
        ref["precision"],
        ref["device"],
        check="calibration run left out",
        compared=f"{run_label(run)} (data seed {run_seed(run)})",
        value="differs: " + "; ".join(differences),
        tolerance="the main run's settings",
        passed=None,
        detail="a calibration or seed run made with other settings says nothing about this "
        "cell's noise; rerun it",
        mode="informational",
    )


def _demoted(verdict: Verdict) -> Verdict:
    """A passing row of a cell where no trained pair was compared: informational, never a pass."""
    if verdict.passed is not True:
        return verdict
    return dataclasses.replace(
        verdict,
        passed=None,
        detail=(verdict.detail + "; " if verdict.detail else "")
        + "informational: no trained torch/JAX pair in this cell to judge",
    )


# --- one pair ----------------------------------------------------------------------------------


def _scale_events(steps: Sequence[Mapping[str, Any]]) -> int:
    events = 0
    previous = None
    for step in steps:
        scale = step.get("loss_scale")
        if step.get("skipped"):
            events += 1
        elif previous is not None and scale is not None and scale != previous:
            events += 1
        previous = scale
    return events


class _Rows:
    def __init__(self, ref, cand):
        self.compared = f"{run_label(cand)} vs {run_label(ref)}"
        self.base = {
            "model": ref["model"],
            "precision": ref["precision"],
            "device": ref["device"],
            "compared": self.compared,
        }
        self.rows: list[Verdict] = []

    def add(self, check, value, tolerance, passed, detail="", **fields):
        self.rows.append(
            Verdict(
                check=check,
                value=value,
                tolerance=tolerance,
                passed=passed,
                detail=detail,
                **self.base,
                **fields,
            )
        )


def _trajectory_rows(out: _Rows, ref, cand, envelope, calibrated_by: str) -> None:
    ref_l, cand_l = run_losses(ref), run_losses(cand)
    floor = loss_floor(ref_l)
    gaps = relative_gaps(ref_l, cand_l, floor)
    n = len(gaps)
    step0 = gaps[0] if gaps else None
    k = TOLERANCES["noise_k"]
    every_tolerance = step_tolerances(gaps, envelope)
    ratio = envelope_ratio(gaps, envelope)
    windows = [
        (0, TOLERANCES["fp32_first"][0]),
        (TOLERANCES["fp32_first"][0], TOLERANCES["fp32_next"][0]),
    ]
    if envelope is not None and n > TOLERANCES["fp32_next"][0]:
        windows.append((TOLERANCES["fp32_next"][0], n))
    if n == 0:
        out.add(
            "per-step loss",
            "no steps on both sides",
            "at least one step",
            False,
            "nothing to compare: a run recorded no steps",
            mode="fixed bands",
        )
        return
    for start, stop in windows:
        stop = min(stop, n)
        if start >= stop:
            continue
        tolerances = every_tolerance[start:stop]
        deciders = [
            "noise-calibrated" if t > step_band(s) else "fixed bands"
            for s, t in zip(range(start, stop), tolerances, strict=True)
        ]
        segment = gaps[start:stop]
        failing = [
            start + i
            for i, (g, t) in enumerate(zip(segment, tolerances, strict=True))
            if not g <= t
        ]
        margins = [g / t for g, t in zip(segment, tolerances, strict=True)]
        worst_i = max(range(len(segment)), key=lambda i: (margins[i], segment[i]))
        worst_step = start + worst_i
        judge_i = failing[0] - start if failing else worst_i
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
            f"{run_label(ref)} {fmt_value(a)}, {run_label(cand)} {fmt_value(b)}) vs tolerance {fmt_value(tolerances[worst_i])}"
        )
        if envelope is not None:
            s = start + judge_i
            env_s = envelope[min(s + TOLERANCES["noise_lag"], len(envelope) - 1)]
            parts.append(
                f"self-divergence ({calibrated_by}) by step {s}+{TOLERANCES['noise_lag']}: {fmt_value(env_s)}; tolerance at step {s} "
                f"{fmt_value(tolerances[judge_i])} from the {deciders[judge_i]}"
                + (
                    f" (k={k:g}, rescaled x{ratio:.3g} to the step-0 gap)"
                    if deciders[judge_i] != "fixed bands"
                    else ""
                )
            )
        label = f"per-step loss, steps {start}-{stop - 1}"
        if envelope is None or mode == "fixed bands":
            tolerance_value: Any = step_band(start)
        else:
            tolerance_value = f"max({step_band(start):.0e}, {k:g} x envelope)"
        out.add(
            label,
            segment[judge_i],
            tolerance_value,
            not failing,
            "; ".join(parts),
            mode=mode,
            first_failing_step=failing[0] if failing else None,
            worst_step=worst_step,
            step0_gap=step0,
            absolute=absolute,
            unit=LOSS_UNIT,
        )


def _fp16_rows(out: _Rows, ref, cand) -> None:
    n = min(len(ref["steps"]), len(cand["steps"]))
    events = max(_scale_events(ref["steps"][:n]), _scale_events(cand["steps"][:n]))
    no_event = events == 0
    note = (
        f"no scale event (no skip, no growth) in {n} steps: the scaler was not exercised, so "
        "this is informational, not a pass; use the fp16 stress setting (init scale 2**20, "
        "growth interval 5: `--fp16-stress`)"
    )
    scales_ref = [s.get("loss_scale") for s in ref["steps"][:n]]
    scales_cand = [s.get("loss_scale") for s in cand["steps"][:n]]
    diff = [i for i in range(n) if scales_ref[i] != scales_cand[i]]
    final = scales_ref[-1] if n else None
    detail = (
        f"{n} steps, {events} scale events; final scale {final}"
        if not diff
        else f"step {diff[0]}: {run_label(ref)} {scales_ref[diff[0]]}, {run_label(cand)} {scales_cand[diff[0]]}"
    )
    out.add(
        "loss-scale trajectory",
        "identical" if not diff else f"differs from step {diff[0]}",
        "identical",
        False if diff or n == 0 else (None if no_event else True),
        note if (no_event and not diff and n) else detail,
        mode="informational" if (no_event and not diff and n) else "exact",
        first_failing_step=diff[0] if diff else None,
    )
    skips_ref = [bool(s.get("skipped")) for s in ref["steps"][:n]]
    skips_cand = [bool(s.get("skipped")) for s in cand["steps"][:n]]
    diff = [i for i in range(n) if skips_ref[i] != skips_cand[i]]
    out.add(
        "skip decisions",
        f"identical ({sum(skips_ref)} skipped)" if not diff else f"differ at steps {diff[:5]}",
        "identical",
        False if diff or n == 0 else (None if no_event else True),
        note
        if (no_event and not diff and n)
        else f"skipped steps: {[i for i in range(n) if skips_ref[i]][:10]}",
        mode="informational" if (no_event and not diff and n) else "exact",
        first_failing_step=diff[0] if diff else None,
    )


# fp8 runs (parity.core.fp8): step 0 holds the same fp8 codes on both sides (checked layer by layer by
# parity.core.fp8.step0_fp8), so its loss is held to the fp32 band; from then on, each side's float32
# summation order flips an fp8 code now and then, and a flip moves an operand by one e4m3 step
# (<= 2 x 2**-4 relative). A one-ulp nudge is absorbed by the fp8 rounding, so self-divergence
# calibration measures ~0 there. Steps 1-9 are held to e4m3's unit roundoff 2**-4, and the run
# to the final-loss band of the other reduced precisions.
FP8_STEP_BAND = 2.0**-4


def _fp8_rows(out: _Rows, ref, cand) -> None:
    ref_l, cand_l = run_losses(ref), run_losses(cand)
    gaps = relative_gaps(ref_l, cand_l, loss_floor(ref_l))[: TOLERANCES["fp32_first"][0]]
    if not gaps:
        out.add("per-step loss", "no steps on both sides", "at least one step", False)
        return
    tolerances = [step_band(0)] + [FP8_STEP_BAND] * (len(gaps) - 1)
    failing = [i for i, (g, t) in enumerate(zip(gaps, tolerances, strict=True)) if not g <= t]
    worst = max(range(len(gaps)), key=lambda i: gaps[i] / tolerances[i])
    out.add(
        f"per-step loss, steps 0-{len(gaps) - 1} (fp8)",
        gaps[worst],
        f"{fmt_value(step_band(0))} at step 0, {fmt_value(FP8_STEP_BAND)} after",
        not failing,
        f"step-0 gap {fmt_value(gaps[0])} relative; worst step {worst}"
        + (f"; first failing step {failing[0]}" if failing else ""),
        mode="fixed bands",
        step0_gap=gaps[0],
        worst_step=worst,
    )


def _final_row(out: _Rows, ref, cand, envelope, seeds_decide: bool) -> None:
    window = TOLERANCES["final_window"]
    ref_l, cand_l = run_losses(ref), run_losses(cand)
    a, b = final_mean(ref_l, window), final_mean(cand_l, window)
    floor = loss_floor(ref_l)
    value = math.inf if a is None or b is None else abs(a - b) / max(abs(a), floor, 1e-30)
    tolerance = TOLERANCES["final_loss_rel"]
    mode = "fixed bands"
    detail = (
        f"{run_label(ref)} {fmt_value(a, LOSS_UNIT)}, {run_label(cand)} {fmt_value(b, LOSS_UNIT)}; "
        f"difference {fmt_value(None if a is None or b is None else abs(a - b), LOSS_UNIT)}, "
        f"relative to max(|{run_label(ref)}|, floor {fmt_value(floor, LOSS_UNIT)} = 1% of the first loss)"
    )
    if envelope is not None and envelope:
        env_final = envelope[min(len(envelope), len(ref_l)) - 1]
        noise = TOLERANCES["noise_k"] * env_final
        if noise > tolerance:
            tolerance, mode = noise, "noise-calibrated"
            detail += (
                f"; self-divergence at the end {fmt_value(env_final)}: tolerance k x envelope "
                "(one run cannot tell chaos from a port bug here: use seed statistics)"
            )
    passed: bool | None = value <= tolerance
    if seeds_decide:
        passed, mode = None, "informational"
        detail += "; decided by the seed statistics row"
    out.add(
        f"final loss (mean of last {window})",
        value,
        tolerance,
        passed,
        detail,
        mode=mode,
        absolute=None if a is None or b is None else abs(a - b),
        unit=LOSS_UNIT,
    )


def _pair_verdicts(
    ref: dict[str, Any],
    cand: dict[str, Any],
    noise: Sequence[dict[str, Any]] = (),
    mains: Mapping[str, dict[str, Any]] | None = None,
    seeds_decide: bool = False,
) -> list[Verdict]:
    out = _Rows(ref, cand)
    errors = [
        f"{run_label(r)}: {r['summary']['error']}"
        for r in (ref, cand)
        if run_status(r) == "error" or r["summary"].get("error")
    ]
    if errors:
        out.add("run completed", "; ".join(errors), "no error", False, mode="exact")
        return out.rows
    differences = config_differences(ref, cand)
    if differences:
        return [_not_comparable(ref, cand, differences)]
    bad = []
    for run in (ref, cand):
        s = run["summary"]
        nonfinite = [st["step"] for st in run["steps"] if st.get("loss") is None]
        if s.get("diverged") or nonfinite:
            first = s.get("first_nonfinite_step", nonfinite[0] if nonfinite else None)
            bad.append(f"{run_label(run)} at step {first}")
    out.add(
        "no divergence",
        "diverged: " + ", ".join(bad) if bad else "all losses finite",
        "finite",
        not bad,
        "a non-finite loss is recorded and reported, not compared" if bad else "",
        mode="exact",
    )
    # The envelope: each calibration run against the main run of its own framework.
    envelope = None
    sources = []
    for run in noise:
        main = (mains or {}).get(run["framework"])
        if main is None:
            continue
        left_out = config_differences(main, run)
        if left_out:
            out.rows.append(_left_out(main, run, left_out))
            continue
        env = self_divergence(main, [run])
        if env is None:
            continue
        sources.append(run_label(run))
        # Equal lengths unless a calibration run stopped early on a non-finite loss: the envelope
        # then covers the steps both have (a diverged nudge fails nothing, it calibrates less).
        if envelope is not None:
            n = min(len(envelope), len(env))
            env = [max(envelope[i], env[i]) for i in range(n)]
        envelope = env
    calibrated_by = ", ".join(sources)
    policy_compute = _compute(ref)
    if policy_compute == "float8":  # torchao's recipes (parity.core.fp8): own band + final
        _fp8_rows(out, ref, cand)
    if policy_compute == "float32":
        _trajectory_rows(out, ref, cand, envelope, calibrated_by)
    elif policy_compute == "float16":
        _fp16_rows(out, ref, cand)
    if policy_compute != "float32":
        _final_row(out, ref, cand, envelope, seeds_decide)
    gaps = relative_gaps(run_losses(ref), run_losses(cand), loss_floor(run_losses(ref)))
    if gaps:
        finite = [g for g in gaps if math.isfinite(g)]
        worst = max(finite) if finite else math.inf
        out.add(
            "max per-step loss difference (all steps)",
            worst,
            "—",
            None,
            f"step-0 gap {fmt_value(gaps[0])}; worst at step {gaps.index(worst) if finite else '—'}"
            + (f"; self-divergence at the end {fmt_value(envelope[-1])}" if envelope else ""),
            mode="informational",
            step0_gap=gaps[0],
            worst_step=gaps.index(worst) if finite else None,
        )
    ea, eb = ref["summary"].get("eval_metric"), cand["summary"].get("eval_metric")
    if ea is not None and eb is not None:
        name = ref["summary"].get("eval_metric_name", "metric")
        out.add(
            f"eval {name}: {run_label(ref)} {ea:.4g}, {run_label(cand)} {eb:.4g}",
            abs(ea - eb),
            "—",
            None,
            mode="informational",
            absolute=abs(ea - eb),
            unit="" if name == "accuracy" else LOSS_UNIT,
        )
    out.rows.extend(logit_rows(ref, cand, envelope))  # language models: eval-logit KL, top-1
    return out.rows


def _compute(run: Mapping[str, Any]) -> str:
    """The dtype a run's matmuls ran in: its recipe's (``"float8"`` for torchao's recipes).

    Raises:
      ValueError: the precision is no recipe's (`parity.core.records.validate_run` refuses such a
        file before it gets here): no other precision's rule judges it.
    """
    return get_recipe(run["precision"]).compute_dtype_name


# --- seed statistics ---------------------------------------------------------------------------


def _welch(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(t, degrees of freedom, two-sided p) of Welch's test; p = 1 when both have no spread."""
    from scipy import stats

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
    result = stats.ttest_ind(xs, ys, equal_var=False)
    df = se2**2 / ((var_x / len(xs)) ** 2 / (len(xs) - 1) + (var_y / len(ys)) ** 2 / (len(ys) - 1))
    return float(result.statistic), float(df), float(result.pvalue)


def _seed_rows(cell: tuple, ref_runs: list, cand_runs: list) -> list[Verdict]:
    """Welch's t-test of final loss and eval metric, K seeds per framework."""
    model, precision, device = cell
    compared = f"{run_label(cand_runs[0])} vs {run_label(ref_runs[0])}, {len(ref_runs)}+{len(cand_runs)} seeds"
    window = TOLERANCES["final_window"]
    alpha = 1 - TOLERANCES["seed_confidence"]
    rows = []
    first_losses = [
        run_losses(r)[0] for r in ref_runs if r["steps"] and run_losses(r)[0] is not None
    ]
    loss_floor = TOLERANCES["final_loss_floor_frac"] * (
        sum(abs(x) for x in first_losses) / len(first_losses) if first_losses else 0.0
    )
    metrics = [
        (
            "final loss",
            lambda r: final_mean(run_losses(r), window),
            loss_floor,
            LOSS_UNIT,
        )
    ]
    name = ref_runs[0]["summary"].get("eval_metric_name", "metric")
    metrics.append(
        (
            f"eval {name}",
            lambda r: r["summary"].get("eval_metric"),
            TOLERANCES["seed_accuracy_floor"] if name == "accuracy" else loss_floor,
            "" if name == "accuracy" else LOSS_UNIT,
        )
    )
    for label, get, floor, unit in metrics:
        xs = [get(r) for r in ref_runs]
        ys = [get(r) for r in cand_runs]
        if any(v is None for v in xs + ys):
            if label.startswith("eval") and all(v is None for v in xs + ys):
                continue
            rows.append(
                Verdict(
                    model,
                    precision,
                    device,
                    f"{label} over seeds (Welch t-test)",
                    compared,
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
        passed = p >= alpha or difference <= floor
        detail = (
            f"Welch's two-sample t-test, two-sided, {TOLERANCES['seed_confidence']:.0%} confidence: "
            f"t = {t:.3g}, df = {df:.3g}, p = {p:.3g}; {run_label(ref_runs[0])} {mean_x:.4g} ± {sd(xs, mean_x):.2g}, "
            f"{run_label(cand_runs[0])} {mean_y:.4g} ± {sd(ys, mean_y):.2g} (mean ± sd over seeds); "
            f"difference {difference:.3g}{(' ' + unit) if unit else ''} "
            f"(absolute floor {floor:.3g}{(' ' + unit) if unit else ''})"
        )
        rows.append(
            Verdict(
                model,
                precision,
                device,
                f"{label} over seeds (Welch t-test)",
                compared,
                p,
                f"p >= {alpha:g} or diff <= floor",
                passed,
                detail,
                mode="seed statistics",
                absolute=difference,
                unit=unit,
            )
        )
    return rows


# --- all runs ----------------------------------------------------------------------------------


def _embedded_verdicts(runs: Iterable[Mapping[str, Any]]) -> list[Verdict]:
    """Verdict rows stored in run records (``run["step0"]["verdicts"]``), deduplicated."""
    seen, out = set(), []
    for run in runs:
        step0 = run.get("step0")
        rows = step0.get("verdicts", []) if isinstance(step0, Mapping) else []
        # A distributed run's own checks (ranks agree, reduction dtypes), stored with its sides.
        rows = [*rows, *run.get("distributed_verdicts", [])]
        for row in rows:
            verdict = Verdict.from_dict(row)
            if not verdict.mode:
                verdict = dataclasses.replace(verdict, mode="step 0")
            key = (verdict.cell, verdict.check, verdict.compared)
            if key not in seen:
                seen.add(key)
                out.append(verdict)
    return out


def compare_runs(
    runs: Sequence[dict[str, Any]], *, extra_verdicts: Iterable[Verdict] = ()
) -> list[Verdict]:
    """Verdicts for every torch/JAX pair among `runs`, grouped by (model, precision, device).

    Args:
      runs: run records (results.json's ``runs``): main runs, calibration runs
        (``variant="noise"``) and seed runs (other ``config.data_seed``) alike.
      extra_verdicts: rows made elsewhere (step-0 checks), listed first in their cell; a
        passing one is informational where the cell has no trained comparable pair.

    Returns:
      `Verdict` rows; a cell without both frameworks gets one row with ``passed=None`` saying so,
      and a pair that is not comparable (`parity.core.records.config_differences`) one row
      (``mode="not comparable"``) naming each differing setting.

    Example:
      >>> compare_runs([])
      []
    """
    groups: dict[tuple, list] = {}
    for run in runs:
        groups.setdefault((run["model"], run["precision"], run["device"]), []).append(run)
    extra = list(extra_verdicts) + _embedded_verdicts(runs)
    verdicts: list[Verdict] = []
    for key in sorted(groups):
        members = groups[key]
        cell_rows: list[Verdict] = []
        unsupported = [r for r in members if run_status(r) == "unsupported"]
        for run in unsupported:
            cell_rows.append(
                Verdict(
                    *key,
                    check="unsupported here",
                    compared=run_label(run),
                    value=run.get("reason", ""),
                    tolerance="—",
                    passed=None,
                    detail="this hardware cannot run the cell: reported, not failed, not passed",
                    mode="unsupported here",
                )
            )
        usable = [r for r in members if run_status(r) != "unsupported"]
        main = [r for r in usable if not r.get("variant")]
        noise = [r for r in usable if r.get("variant") == "noise"]
        seeds = sorted({run_seed(r) for r in main})
        label_pairs = comparable_labels(main)
        compared_any = judged_any = False
        for seed in seeds:
            here = {run_label(r) for r in main if run_seed(r) == seed}
            if any(label in here and jax_label in here for label, jax_label in label_pairs):
                primary_seed = seed
                break
        else:
            primary_seed = None
        if primary_seed is not None:
            at_seed = [r for r in main if run_seed(r) == primary_seed]
            noise_here = [r for r in noise if run_seed(r) == primary_seed]
            reported: set[int] = set()
            for label, jax_label in label_pairs:
                ref = next((r for r in at_seed if run_label(r) == label), None)
                jax_main = next((r for r in at_seed if run_label(r) == jax_label), None)
                if ref is None or jax_main is None:
                    continue
                ref_seeds, jax_seeds = [], []
                for run in main:
                    if run_label(run) in (label, jax_label):
                        mine = ref if run["framework"] == "torch" else jax_main
                        left_out = config_differences(mine, run)
                        if left_out:
                            if run_seed(run) != primary_seed and id(run) not in reported:
                                reported.add(id(run))
                                cell_rows.append(_left_out(mine, run, left_out))
                            continue
                        (ref_seeds if run["framework"] == "torch" else jax_seeds).append(run)
                common = sorted({run_seed(r) for r in ref_seeds} & {run_seed(r) for r in jax_seeds})
                seeds_decide = len(common) >= 2
                mains = {"torch": ref, "jax": jax_main}
                rows = _pair_verdicts(ref, jax_main, noise_here, mains, seeds_decide)
                cell_rows.extend(rows)
                compared_any = True
                if any(v.mode == "not comparable" for v in rows):
                    continue
                judged_any = True
                if seeds_decide:
                    cell_rows.extend(
                        _seed_rows(
                            key,
                            sorted(
                                (r for r in ref_seeds if run_seed(r) in common),
                                key=run_seed,
                            ),
                            sorted(
                                (r for r in jax_seeds if run_seed(r) in common),
                                key=run_seed,
                            ),
                        )
                    )
        if not compared_any and usable:
            present = ", ".join(sorted({run_label(r) for r in usable}))
            cell_rows.append(
                Verdict(
                    *key,
                    check="pair",
                    compared=present,
                    value="only " + present,
                    tolerance="torch and jax",
                    passed=None,
                    detail="nothing compared: a cell needs a torch run and a JAX run with the "
                    "same data seed (never a pass)",
                    mode="nothing compared",
                )
            )
        # Step-0 rows judge a pair before training; without a trained, comparable pair in the
        # cell (one framework, a not-comparable pair) they are informational, never its PASS.
        here = [v if judged_any else _demoted(v) for v in extra if v.cell == key]
        verdicts.extend(here + cell_rows)
    cells = set(groups)
    verdicts.extend(_demoted(v) for v in extra if v.cell not in cells)
    return verdicts
