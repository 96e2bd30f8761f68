"""Tolerances and verdicts: does the JAX run train like the torch run?

For every (model, precision, device) cell with a torch run and a JAX run (each torch mode, eager
and torch.compile, is compared with JAX separately), on the main data seed:

- ``no divergence`` (all precisions): neither run has a non-finite loss. A run that raised fails
  ``run completed``; a cell this hardware cannot run is reported ``unsupported here`` (never a
  failure, never a pass).
- **per-step loss** (fp32): the relative gap ``|L_jax - L_torch| / max(|L_torch|, 1% of the
  first torch loss)`` (the floor keeps losses trained to ~0 from producing meaningless 100%
  gaps) must stay within the **fixed bands**: 1e-4 for steps 0-9, 1e-3 for steps 10-29.
  **Noise-calibrated mode**, when calibration runs (``variant="noise"``: the same framework
  started from weights nudged by one ulp, see `parity.calibrate`) are present: the model's own
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
  informational, never a pass (use the fp16 stress setting, `parity.config.FP16_STRESS`).
- **final loss** (mixed and bf16-true precisions): the mean of the last 5 losses within 5%
  relative (same floor as above). With calibration runs the tolerance is at least ``k`` times
  the envelope there. With K > 1 data seeds per framework (`parity.calibrate.seed_runs`),
  **seed statistics** decide instead: final loss and eval metric are compared across frameworks
  with Welch's two-sample t-test (two-sided, 95% confidence); the difference passes when the
  test does not reject equal means or when it is below the absolute floor (1% of the first loss
  for losses, 0.01 for accuracy).
- informational: max per-step relative gap over the whole run, eval metric difference.

Step-0 checks (`parity.step0`) plug in as extra `Verdict` rows: pass them to `compare_runs`
(``extra_verdicts=``) or store ``run["step0"] = Step0Result.to_dict()`` in a run record; both
appear in the verdict table and the report (``parity.report`` renders ``step0.diagnosis``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from parity.config import FP8_PRECISIONS
from parity.records import run_label, run_seed, run_status

__all__ = [
    "TOLERANCES",
    "Verdict",
    "cell_bottom_lines",
    "compare_runs",
    "compared_pairs",
    "format_verdicts",
    "overall_status",
    "self_divergence",
]

TOLERANCES = {
    "fp32_first": (10, 1e-4),  # (steps, relative tolerance)
    "fp32_next": (30, 1e-3),
    "final_loss_rel": 0.05,
    "final_window": 5,
    "final_loss_floor_frac": 0.01,  # of the first loss: the relative gap's denominator floor
    "noise_k": 10.0,  # the cross-framework gap may be k times the self-divergence envelope
    "noise_floor": 2.0**-24,  # smallest self-divergence credited at step 0 (a float32 half-ulp)
    "noise_lag": 2,  # steps the envelope is read ahead (see the module docstring)
    "seed_confidence": 0.95,  # Welch's t-test level
    "seed_accuracy_floor": 0.01,  # absolute floor for accuracy differences
}

LOSS_UNIT = "nats"  # mean cross-entropy


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One check of one torch/JAX pair. `passed` is None for informational rows.

    Attributes:
      model, precision, device: the cell.
      check: what was checked, e.g. ``"per-step loss, steps 0-9"``.
      compared: which runs, e.g. ``"jax vs torch"``.
      value: the measured figure (relative unless the row says otherwise).
      tolerance: the bound it was held to.
      passed: True, False, or None (informational / nothing to judge).
      detail: the explanation: step-0 gap, first failing step, worst step, absolute values.
      mode: what decided: ``"fixed bands"``, ``"noise-calibrated"``, ``"seed statistics"``,
        ``"exact"``, ``"step 0"``, ``"informational"``, ``"unsupported here"``...
      first_failing_step, worst_step: steps (None where not per-step).
      step0_gap: relative loss gap at step 0 (None where not measured).
      absolute: the absolute difference behind `value`, in `unit`.
      unit: unit of `absolute` (``"nats"`` for losses).

    Example:
      >>> v = Verdict("mlp", "fp32", "cpu", "per-step loss, steps 0-9", "jax vs torch", 3e-6,
      ...             1e-4, True)
      >>> v.value_text, v.tolerance_text
      ('3e-06', '1e-04')
    """

    model: str
    precision: str
    device: str
    check: str
    compared: str
    value: Any
    tolerance: Any
    passed: bool | None
    detail: str = ""
    mode: str = ""
    first_failing_step: int | None = None
    worst_step: int | None = None
    step0_gap: float | None = None
    absolute: float | None = None
    unit: str = ""

    @property
    def value_text(self) -> str:
        if isinstance(self.value, float):
            return f"{self.value:.3g}"
        return str(self.value)

    @property
    def tolerance_text(self) -> str:
        if isinstance(self.tolerance, float):
            if not math.isfinite(self.tolerance):
                return str(self.tolerance)
            return f"{self.tolerance:.0e}" if self.tolerance < 0.01 else f"{self.tolerance:.0%}"
        return str(self.tolerance)

    @property
    def cell(self) -> tuple[str, str, str]:
        return (self.model, self.precision, self.device)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        """Reads `to_dict` output (unknown keys are ignored: rows from newer versions load)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# --- numbers -----------------------------------------------------------------------------------


def _losses(run: Mapping[str, Any]) -> list[float | None]:
    out = []
    for step in run["steps"]:
        loss = step.get("loss")
        out.append(loss if isinstance(loss, int | float) and math.isfinite(loss) else None)
    return out


def _floor(ref_losses: Sequence[float | None]) -> float:
    first = next((x for x in ref_losses if x is not None), None)
    return TOLERANCES["final_loss_floor_frac"] * abs(first) if first else 0.0


def _gaps(ref: Sequence[float | None], cand: Sequence[float | None], floor: float) -> list[float]:
    """Per-step relative gaps (inf where either loss is missing)."""
    out = []
    for a, b in zip(ref, cand, strict=False):
        if a is None or b is None:
            out.append(math.inf)
        else:
            out.append(abs(a - b) / max(abs(a), floor, 1e-30))
    return out


def _final(losses: Sequence[float | None], window: int) -> float | None:
    tail = list(losses[-window:])
    if not tail or any(x is None for x in tail):
        return None
    return sum(tail) / len(tail)


def self_divergence(
    main: Mapping[str, Any], noise_runs: Iterable[Mapping[str, Any]]
) -> list[float] | None:
    """The self-divergence envelope: running max over steps of the noise-vs-main relative gap.

    Args:
      main: the unperturbed run.
      noise_runs: calibration runs of the same cell (``variant="noise"``), any framework; each
        is measured against the main run of its own framework by the caller.

    Returns:
      ``env[s]`` per step (max over calibration runs), or None without a usable calibration run.

    Example:
      >>> main = {"steps": [{"loss": 2.0}, {"loss": 1.0}]}
      >>> noisy = {"steps": [{"loss": 2.0}, {"loss": 1.1}]}
      >>> [round(x, 3) for x in self_divergence(main, [noisy])]
      [0.0, 0.1]
    """
    ref = _losses(main)
    floor = _floor(ref)
    envelope = None
    for run in noise_runs:
        gaps = _gaps(ref, _losses(run), floor)
        if not gaps:
            continue
        running, acc = [], 0.0
        for g in gaps:
            acc = max(acc, g)
            running.append(acc)
        if envelope is None:
            envelope = running
        else:
            n = min(len(envelope), len(running))
            envelope = [max(envelope[i], running[i]) for i in range(n)]
    return envelope


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "no finite value"
    return f"{x:.3g}{(' ' + unit) if unit else ''}"


# --- one pair ----------------------------------------------------------------------------------


def _band(step: int) -> float:
    first_stop, first_tol = TOLERANCES["fp32_first"]
    _, next_tol = TOLERANCES["fp32_next"]
    return first_tol if step < first_stop else next_tol


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
    ref_l, cand_l = _losses(ref), _losses(cand)
    floor = _floor(ref_l)
    gaps = _gaps(ref_l, cand_l, floor)
    n = len(gaps)
    step0 = gaps[0] if gaps else None
    k = TOLERANCES["noise_k"]
    if envelope is not None:
        env0 = max(envelope[0], TOLERANCES["noise_floor"]) if envelope else 1.0
        saturation = max((e for e in envelope if math.isfinite(e)), default=0.0)
        ratio = 1.0
        if step0 is not None and math.isfinite(step0) and step0 <= _band(0):
            ratio = max(1.0, step0 / env0)
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
        tolerances, deciders = [], []
        for s in range(start, stop):
            band = _band(s)
            noise = 0.0
            if envelope is not None and s > 0 and envelope:
                ahead = envelope[min(s + TOLERANCES["noise_lag"], len(envelope) - 1)]
                noise = k * min(ratio * ahead, saturation)
            tolerances.append(max(band, noise))
            deciders.append("noise-calibrated" if noise > band else "fixed bands")
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
        parts = [f"step-0 gap {_fmt(step0)} relative"]
        if failing:
            parts.append(
                f"first failing step {failing[0]} ({len(failing)} of {stop - start} steps fail)"
            )
        else:
            parts.append("no step fails")
        parts.append(
            f"worst step {worst_step}: {_fmt(segment[worst_i])} relative ({_fmt(absolute, LOSS_UNIT)}; "
            f"{run_label(ref)} {_fmt(a)}, {run_label(cand)} {_fmt(b)}) vs tolerance {_fmt(tolerances[worst_i])}"
        )
        if envelope is not None:
            s = start + judge_i
            env_s = envelope[min(s + TOLERANCES["noise_lag"], len(envelope) - 1)]
            parts.append(
                f"self-divergence ({calibrated_by}) by step {s}+{TOLERANCES['noise_lag']}: {_fmt(env_s)}; tolerance at step {s} "
                f"{_fmt(tolerances[judge_i])} from the {deciders[judge_i]}"
                + (
                    f" (k={k:g}, rescaled x{ratio:.3g} to the step-0 gap)"
                    if deciders[judge_i] != "fixed bands"
                    else ""
                )
            )
        label = f"per-step loss, steps {start}-{stop - 1}"
        if envelope is None or mode == "fixed bands":
            tolerance_value: Any = _band(start)
        else:
            tolerance_value = f"max({_band(start):.0e}, {k:g} x envelope)"
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


# fp8 runs (parity.fp8): step 0 holds the same fp8 codes on both sides (checked layer by layer by
# parity.fp8.step0_fp8), so its loss is held to the fp32 band; from then on, each side's float32
# summation order flips an fp8 code now and then, and a flip moves an operand by one e4m3 step
# (<= 2 x 2**-4 relative). A one-ulp nudge is absorbed by the fp8 rounding, so self-divergence
# calibration measures ~0 there. Steps 1-9 are held to e4m3's unit roundoff 2**-4, and the run
# to the final-loss band of the other reduced precisions.
FP8_STEP_BAND = 2.0**-4


def _fp8_rows(out: _Rows, ref, cand) -> None:
    ref_l, cand_l = _losses(ref), _losses(cand)
    gaps = _gaps(ref_l, cand_l, _floor(ref_l))[: TOLERANCES["fp32_first"][0]]
    if not gaps:
        out.add("per-step loss", "no steps on both sides", "at least one step", False)
        return
    tolerances = [_band(0)] + [FP8_STEP_BAND] * (len(gaps) - 1)
    failing = [i for i, (g, t) in enumerate(zip(gaps, tolerances, strict=True)) if not g <= t]
    worst = max(range(len(gaps)), key=lambda i: gaps[i] / tolerances[i])
    out.add(
        f"per-step loss, steps 0-{len(gaps) - 1} (fp8)",
        gaps[worst],
        f"{_fmt(_band(0))} at step 0, {_fmt(FP8_STEP_BAND)} after",
        not failing,
        f"step-0 gap {_fmt(gaps[0])} relative; worst step {worst}"
        + (f"; first failing step {failing[0]}" if failing else ""),
        mode="fixed bands",
        step0_gap=gaps[0],
        worst_step=worst,
    )


def _final_row(out: _Rows, ref, cand, envelope, seeds_decide: bool) -> None:
    window = TOLERANCES["final_window"]
    ref_l, cand_l = _losses(ref), _losses(cand)
    a, b = _final(ref_l, window), _final(cand_l, window)
    floor = _floor(ref_l)
    value = math.inf if a is None or b is None else abs(a - b) / max(abs(a), floor, 1e-30)
    tolerance = TOLERANCES["final_loss_rel"]
    mode = "fixed bands"
    detail = (
        f"{run_label(ref)} {_fmt(a, LOSS_UNIT)}, {run_label(cand)} {_fmt(b, LOSS_UNIT)}; "
        f"difference {_fmt(None if a is None or b is None else abs(a - b), LOSS_UNIT)}, "
        f"relative to max(|{run_label(ref)}|, floor {_fmt(floor, LOSS_UNIT)} = 1% of the first loss)"
    )
    if envelope is not None and envelope:
        env_final = envelope[min(len(envelope), len(ref_l)) - 1]
        noise = TOLERANCES["noise_k"] * env_final
        if noise > tolerance:
            tolerance, mode = noise, "noise-calibrated"
            detail += (
                f"; self-divergence at the end {_fmt(env_final)}: tolerance k x envelope "
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
        env = self_divergence(main, [run])
        if env is None:
            continue
        sources.append(run_label(run))
        envelope = (
            env if envelope is None else [max(x, y) for x, y in zip(envelope, env, strict=False)]
        )
    calibrated_by = ", ".join(sources)
    policy_compute = _compute(ref)
    if ref["precision"] in FP8_PRECISIONS:  # torchao's recipes (parity.fp8): own band + final
        policy_compute = "float8"
        _fp8_rows(out, ref, cand)
    if policy_compute == "float32":
        _trajectory_rows(out, ref, cand, envelope, calibrated_by)
    elif policy_compute == "float16":
        _fp16_rows(out, ref, cand)
    if policy_compute != "float32":
        _final_row(out, ref, cand, envelope, seeds_decide)
    gaps = _gaps(_losses(ref), _losses(cand), _floor(_losses(ref)))
    if gaps:
        finite = [g for g in gaps if math.isfinite(g)]
        worst = max(finite) if finite else math.inf
        out.add(
            "max per-step loss difference (all steps)",
            worst,
            "—",
            None,
            f"step-0 gap {_fmt(gaps[0])}; worst at step {gaps.index(worst) if finite else '—'}"
            + (f"; self-divergence at the end {_fmt(envelope[-1])}" if envelope else ""),
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
    return out.rows


def _compute(run: Mapping[str, Any]) -> str:
    """The compute dtype of a run's policy (from the record's policy string)."""
    import jaxamp

    spec = run.get("policy") or (run.get("config") or {}).get("policy") or run["precision"]
    try:
        return jaxamp.get_policy(spec).compute_dtype.name
    except (ValueError, TypeError):
        return {"fp32": "float32", "fp16-mixed": "float16"}.get(run["precision"], "bfloat16")


# --- seed statistics ---------------------------------------------------------------------------


def _welch(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(t, degrees of freedom, two-sided p) of Welch's test; p = 1 when both have no spread."""
    from scipy import stats

    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var_x = sum((x - mean_x) ** 2 for x in xs) / (len(xs) - 1)
    var_y = sum((y - mean_y) ** 2 for y in ys) / (len(ys) - 1)
    se2 = var_x / len(xs) + var_y / len(ys)
    if se2 == 0:
        return (0.0 if mean_x == mean_y else math.inf), math.nan, 1.0 if mean_x == mean_y else 0.0
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
    first_losses = [_losses(r)[0] for r in ref_runs if r["steps"] and _losses(r)[0] is not None]
    loss_floor = TOLERANCES["final_loss_floor_frac"] * (
        sum(abs(x) for x in first_losses) / len(first_losses) if first_losses else 0.0
    )
    metrics = [("final loss", lambda r: _final(_losses(r), window), loss_floor, LOSS_UNIT)]
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
      extra_verdicts: rows made elsewhere (step-0 checks), listed first in their cell.

    Returns:
      `Verdict` rows; a cell without both frameworks gets one row with ``passed=None`` saying so.

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
        verdicts.extend(v for v in extra if v.cell == key)
        unsupported = [r for r in members if run_status(r) == "unsupported"]
        for run in unsupported:
            verdicts.append(
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
        torch_labels = sorted({run_label(r) for r in main if r["framework"] == "torch"})
        compared_any = False
        for seed in seeds:
            at_seed = [r for r in main if run_seed(r) == seed]
            jax_runs = [r for r in at_seed if r["framework"] == "jax"]
            for label in torch_labels:
                refs = [r for r in at_seed if run_label(r) == label]
                if refs and jax_runs:
                    primary_seed = seed
                    break
            else:
                continue
            break
        else:
            primary_seed = None
        if primary_seed is not None:
            at_seed = [r for r in main if run_seed(r) == primary_seed]
            jax_main = next(r for r in at_seed if r["framework"] == "jax")
            noise_here = [r for r in noise if run_seed(r) == primary_seed]
            for label in torch_labels:
                ref = next((r for r in at_seed if run_label(r) == label), None)
                if ref is None:
                    continue
                ref_seeds = [r for r in main if run_label(r) == label]
                jax_seeds = [r for r in main if r["framework"] == "jax"]
                common = sorted({run_seed(r) for r in ref_seeds} & {run_seed(r) for r in jax_seeds})
                seeds_decide = len(common) >= 2
                mains = {"torch": ref, "jax": jax_main}
                verdicts.extend(_pair_verdicts(ref, jax_main, noise_here, mains, seeds_decide))
                compared_any = True
                if seeds_decide:
                    verdicts.extend(
                        _seed_rows(
                            key,
                            sorted((r for r in ref_seeds if run_seed(r) in common), key=run_seed),
                            sorted((r for r in jax_seeds if run_seed(r) in common), key=run_seed),
                        )
                    )
        if not compared_any and usable:
            present = ", ".join(sorted({run_label(r) for r in usable}))
            verdicts.append(
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
    cells = set(groups)
    verdicts.extend(v for v in extra if v.cell not in cells)
    return verdicts


def compared_pairs(verdicts: Iterable[Verdict]) -> set[tuple[str, str, str, str]]:
    """The (model, precision, device, compared) pairs that were actually compared."""
    return {
        (*v.cell, v.compared)
        for v in verdicts
        if v.mode not in ("nothing compared", "unsupported here") and v.check != "pair"
    }


def overall_status(verdicts: Sequence[Verdict]) -> str:
    """``"FAIL"`` (a verdict failed), ``"NOTHING COMPARED"`` (no torch/JAX pair was compared),
    else ``"PASS"``.

    Example:
      >>> overall_status([])
      'NOTHING COMPARED'
    """
    if any(v.passed is False for v in verdicts):
        return "FAIL"
    if not any(v.passed is True for v in verdicts):
        return "NOTHING COMPARED"
    return "PASS"


def cell_bottom_lines(verdicts: Sequence[Verdict]) -> dict[tuple[str, str, str], str]:
    """One parity sentence per cell: pass/fail and why.

    Example:
      >>> cell_bottom_lines([])
      {}
    """
    cells: dict[tuple, list[Verdict]] = {}
    for v in verdicts:
        cells.setdefault(v.cell, []).append(v)
    out = {}
    for cell, rows in cells.items():
        failed = [v for v in rows if v.passed is False]
        passed = [v for v in rows if v.passed is True]
        if failed:
            first = failed[0]
            where = (
                f" (first failing step {first.first_failing_step})"
                if first.first_failing_step is not None
                else ""
            )
            out[cell] = (
                f"parity FAIL: {first.check} — {first.value_text} against {first.tolerance_text}"
                f"{where}{'; ' + first.mode if first.mode else ''}"
                + (f"; {len(failed) - 1} more failing check(s)" if len(failed) > 1 else "")
            )
        elif passed:
            modes = sorted({v.mode for v in passed if v.mode and v.mode != "exact"})
            info = [
                v
                for v in rows
                if v.passed is None and v.mode == "informational" and "scale" in v.check
            ]
            text = f"parity PASS: {len(passed)} checks" + (
                f", decided by {', '.join(modes)}" if modes else ""
            )
            if info:
                text += (
                    "; the loss-scale trajectory was NOT tested (no skip, no growth: "
                    "informational, not a pass)"
                )
            out[cell] = text
        else:
            reasons = sorted({v.detail or v.value_text for v in rows if v.passed is None})
            out[cell] = "nothing judged (never a pass): " + "; ".join(reasons)[:300]
    return out


def format_verdicts(verdicts: list[Verdict]) -> str:
    """A plain-text table for the terminal, then the explanation of every failing row."""
    rows = [
        (
            "model",
            "precision",
            "device",
            "check",
            "compared",
            "value",
            "tolerance",
            "mode",
            "verdict",
        )
    ]
    for v in verdicts:
        mark = {True: "pass", False: "FAIL", None: "info"}[v.passed]
        rows.append(
            (
                v.model,
                v.precision,
                v.device,
                v.check,
                v.compared,
                v.value_text,
                v.tolerance_text,
                v.mode,
                mark,
            )
        )
    widths = [min(max(len(r[i]) for r in rows), 48) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell[:48].ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    ]
    failed = [v for v in verdicts if v.passed is False]
    passed = sum(v.passed is True for v in verdicts)
    for v in failed:
        lines.append(f"FAIL {v.model} {v.precision} {v.check}: {v.detail}")
    status = overall_status(verdicts)
    lines.append(f"{passed} passed, {len(failed)} failed: {status}")
    if status == "NOTHING COMPARED":
        lines.append(
            "no torch/JAX pair was compared (need both frameworks with the same data seed)"
        )
    return "\n".join(lines)
