"""Verdict rows and the numbers they are made of: one `Verdict` per check, per-step relative
gaps with their floor, the self-divergence envelope, and what is said about a set of rows
(`overall_status`, `cell_bottom_lines`, `format_verdicts`). `parity.verdicts.judge` makes a
trained pair's rows; `parity.verdicts.step0`, the distributed runner and the report use them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from parity.core.flags import run_arguments
from parity.verdicts.checks import check_of
from parity.verdicts.tolerances import POWER_BOUNDS, TOLERANCES

__all__ = [
    "EXCEEDED",
    "LOSS_UNIT",
    "PADDING_CHECK",
    "cell_bottom_lines",
    "cell_configs",
    "cell_fields",
    "deciding_command",
    "final_mean",
    "fmt_value",
    "format_verdicts",
    "is_decisive",
    "loss_floor",
    "loss_gaps",
    "no_power_note",
    "overall_status",
    "power_bound",
    "relative_gaps",
    "Row",
    "run_losses",
    "running_envelope",
    "seeds_to_decide",
    "self_divergence",
    "signal_gaps",
    "stated_power",
    "Verdict",
    "verdict_mark",
]


# The mode of a row that exceeded its band with power and whose failure a stated reason excuses
# (`parity.verdicts.qualifiers`): undecided, never a FAIL, never inside a PASS.
EXCEEDED = "exceeded"

# The label of the step-0 row naming torch embedding rows that never train (kind "padding rows",
# `parity.verdicts.step0_checks`); `parity.verdicts.judge` finds the row by its kind.
PADDING_CHECK = "step 0: embedding rows torch never trains (padding_idx)"


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
      kind: the row's check kind (`parity.verdicts.checks.CHECKS`; empty only in rows stored
        before rows had kinds): with `window`, the row's identity.
      window: ``(start, stop)``: the steps the row covers (None where not per step).
      seeds_needed: an undecided seed-statistics row: the seeds per framework that would
        decide at the observed spread.
      qualified_by: the last qualifier (`parity.verdicts.qualifiers.QUALIFIERS`) that made the
        row undecided, ``""`` for none.
      power: the smallest relative difference the check could have detected (its tolerance for
        a band, 0 for an exact comparison, the equivalence margin for seed statistics); None
        where it cannot be stated. A row that would pass with a power above its bound
        (`POWER_BOUNDS`, `power_bound`) is judged inconclusive before it is frozen (the
        qualifier "no power", `parity.verdicts.qualifiers`): ``passed`` None, mode
        ``"inconclusive"``, the reason in `detail`.

    A `Verdict` is frozen: it is made by `Row.freeze`, after the qualifiers
    (`parity.verdicts.qualifiers.qualify`, or `parity.verdicts.qualifiers.verdict` for a row
    made outside a trained pair's judging pass), or read back by `from_dict`.

    Example:
      >>> v = Verdict("mlp", "fp32", "cpu", "per-step loss, steps 0-9", "jax vs torch", 3e-6,
      ...             1e-4, True, kind="loss")
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
    power: float | None = None
    kind: str = ""
    window: tuple[int, int] | None = None
    seeds_needed: int | None = None
    qualified_by: str = ""

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
        """Reads `to_dict` output (unknown keys are ignored: rows from newer versions load; a
        row stored before rows had a ``power`` gets its stated power, `stated_power`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        if fields.get("window") is not None:  # JSON holds it as a list
            fields["window"] = tuple(fields["window"])
        if "power" not in fields:  # stored before rows stated their power
            fields["power"] = stated_power(None, fields["tolerance"], fields.get("mode", ""))
        return cls(**fields)


def stated_power(power: float | None, tolerance: Any, mode: str) -> float | None:
    """The smallest difference a row could detect: its `power`, else a numeric tolerance, else 0
    for an exact comparison (mode ``"exact"``), else None.

    Example:
      >>> stated_power(None, 0.05, "fixed bands"), stated_power(None, "finite", "exact")
      (0.05, 0.0)
    """
    if power is not None:
        return power
    if isinstance(tolerance, int | float):
        return float(tolerance)
    return 0.0 if mode == "exact" else None


@dataclasses.dataclass
class Row:
    """A row being judged: `Verdict`'s fields but the cell's, its identity (`kind`, `window`:
    the steps it covers) and what the qualifiers need (`parity.verdicts.qualifiers`); `freeze`
    makes the `Verdict`."""

    kind: str
    check: str
    value: Any
    tolerance: Any
    passed: bool | None
    detail: str = ""
    mode: str = ""
    window: tuple[int, int] | None = None
    first_failing_step: int | None = None
    worst_step: int | None = None
    step0_gap: float | None = None
    absolute: float | None = None
    unit: str = ""
    power: float | None = None
    # uncalibrated: a failure past the chaos step is undecided (a per-step row: its windows from
    # the chaos step on; an eval logit row: an eval point past it)
    split_at_chaos: bool = False
    seeds_needed: int | None = None  # an undecided equivalence row: seeds that would decide
    late: bool = False  # listed after the pair's first rows (signals, seeds, fp16 explanations)
    qualified: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def stored(cls, data: Mapping[str, Any]) -> tuple[dict[str, Any], Row]:
        """A row a run record stores (`Verdict.to_dict`'s keys) as a row to judge in its cell,
        and its cell and pair (model, precision, device, compared): what `freeze` takes."""
        fields = Verdict.from_dict(data).to_dict()
        base = {k: fields.pop(k) for k in ("model", "precision", "device", "compared")}
        qualified_by = fields.pop("qualified_by")
        return base, cls(**fields, qualified=[qualified_by] if qualified_by else [])

    def bound(self) -> float:
        return power_bound(self.kind)

    def stated_power(self) -> float | None:
        return stated_power(self.power, self.tolerance, self.mode)

    def freeze(self, base: Mapping[str, Any]) -> Verdict:
        """The `Verdict` of this row in the cell and pair `base` (model, precision, device,
        compared)."""
        fields = {name: getattr(self, name) for name in _VERDICT_FIELDS}
        qualified_by = self.qualified[-1] if self.qualified else ""
        return Verdict(**fields, power=self.stated_power(), qualified_by=qualified_by, **base)


# The fields a `Row` hands its `Verdict` as they are (power is stated, qualified_by the last
# qualifier, the cell and pair come from the judging pass).
_VERDICT_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(Verdict)
    if f.name in {f.name for f in dataclasses.fields(Row)} and f.name != "power"
)


def cell_fields(config: Any) -> dict[str, str]:
    """A `Verdict`'s cell fields (model, precision, device) from a run config."""
    return {"model": config.model, "precision": config.precision, "device": config.device}


def no_power_note(power: float, kind: str = "") -> str:
    """Why a row whose tolerance `power` is above its kind's bound decides nothing.

    Example:
      >>> no_power_note(0.5, "grad norm")[:48]
      'no power: the tolerance 0.5 exceeds the bound 0.'
    """
    bound = power_bound(kind)
    return (
        f"no power: the tolerance {fmt_value(power)} exceeds the bound {fmt_value(bound)} for a "
        f"{check_of(kind).quantity} (a difference up to {fmt_value(power)} would pass), so this "
        "row decides nothing"
    )


def power_bound(kind: str = "") -> float:
    """The largest tolerance a row of `kind` may have and still decide (`POWER_BOUNDS`), by
    the quantity its check compares (`parity.verdicts.checks.CHECKS`); a row without a kind
    (stored before rows had kinds) is a relative error's.

    Example:
      >>> power_bound("final loss"), power_bound("grad norm"), power_bound("")
      (0.2, 0.2, 1.0)
    """
    return POWER_BOUNDS[check_of(kind).quantity]


def is_decisive(v: Verdict) -> bool:
    """A passing row that could have failed and looks past step 0: what a PASS needs.

    Step-0 rows (mode ``"step 0"``: the gate, the compute dtype), rows of a kind that is not
    decisive (`parity.verdicts.checks.Check.decisive`: a run completed, its losses finite) and
    informational rows do not count; neither does a row whose power is above its bound (those
    are judged inconclusive before they are frozen).
    """
    if v.passed is not True or v.mode == "step 0" or not check_of(v.kind).decisive:
        return False
    return v.power is None or v.power <= power_bound(v.kind)


def deciding_command(
    cell: tuple[str, str, str],
    seeds: int = TOLERANCES["deciding_seeds"],
    config: Mapping[str, Any] | None = None,
) -> str:
    """The command that decides an inconclusive cell: seed statistics (an equivalence test,
    `seeds` data seeds per framework) and 1-ulp calibration runs, for a built-in model or
    through `parity.compare_models`.

    `config` (the cell's run record ``config``): the command reruns that run, with every setting
    the command line can set (`parity.core.flags.run_arguments`: steps, batch size, learning
    rate, data, model overrides...) and only the deciding options added; settings the command
    line cannot set are named. Without it, the cell's model, precision and device alone.

    Example:
      >>> deciding_command(("resnet", "fp32", "cpu"))[:60]
      'python -m parity run --model resnet --precision fp32 --devic'
    """
    model, precision, device = cell
    args, unset = run_arguments(
        {"model": model, "precision": precision, "device": device, **(config or {})}
    )
    args += ["--noise", "torch", "--seeds", str(seeds), "--out", f"runs/{model}-{precision}-seeds"]
    own = f"your own pair: compare_models(..., noise='torch', seeds={seeds})"
    if unset:
        own += f"; not settable from the command line: {', '.join(unset)}"
    return f"{shlex.join(['python', '-m', 'parity', 'run', *args])} ({own})"


def run_losses(run: Mapping[str, Any]) -> list[float | None]:
    out = []
    for step in run["steps"]:
        loss = step.get("loss")
        out.append(loss if isinstance(loss, int | float) and math.isfinite(loss) else None)
    return out


def loss_floor(ref_losses: Sequence[float | None]) -> float:
    first = next((x for x in ref_losses if x is not None), None)
    return TOLERANCES["final_loss_floor_frac"] * abs(first) if first else 0.0


def relative_gaps(
    ref: Sequence[float | None], cand: Sequence[float | None], floor: float
) -> list[float]:
    """Per-step relative gaps (inf where either loss is missing)."""
    out = []
    for a, b in zip(ref, cand, strict=False):
        if a is None or b is None:
            out.append(math.inf)
        else:
            out.append(abs(a - b) / max(abs(a), floor, 1e-30))
    return out


def final_mean(losses: Sequence[float | None], window: int) -> float | None:
    tail = list(losses[-window:])
    if not tail or any(x is None for x in tail):
        return None
    return sum(tail) / len(tail)


def running_envelope(gaps: Iterable[Sequence[float] | None]) -> list[float] | None:
    """Per step, the running maximum over steps of each gap series, the largest over the series
    (the steps all of them have); None without a non-empty series.

    Example:
      >>> running_envelope([[0.1, 0.0, 0.3], [0.2, 0.1]])
      [0.2, 0.2]
    """
    envelope = None
    for series in gaps:
        if not series:
            continue
        running = list(itertools.accumulate(series, max))
        envelope = (
            running
            if envelope is None
            else [max(a, b) for a, b in zip(envelope, running, strict=False)]
        )
    return envelope


def loss_gaps(main: Mapping[str, Any], run: Mapping[str, Any]) -> list[float]:
    """Per step, the relative loss gap of `run` to `main` (`relative_gaps`, floored at 1% of
    `main`'s first loss)."""
    ref = run_losses(main)
    return relative_gaps(ref, run_losses(run), loss_floor(ref))


def self_divergence(
    noise: Iterable[Mapping[str, Any]],
    mains: Mapping[str, Mapping[str, Any]],
    gaps: Callable[[Any, Any], Sequence[float] | None] = loss_gaps,
) -> list[float] | None:
    """The self-divergence envelope: per step, the running maximum over steps of each
    calibration run's gap to its own framework's main run, the largest over them.

    Args:
      noise: calibration runs (``variant="noise"``), any framework.
      mains: framework -> the unperturbed main run.
      gaps: ``(main, run) -> per-step gaps``: the loss's (`loss_gaps`), or a recorded
        signal's (`signal_gaps`).

    Returns:
      ``env[s]`` per step, or None without a usable calibration run.

    Example:
      >>> main = {"framework": "torch", "steps": [{"loss": 2.0}, {"loss": 1.0}]}
      >>> noisy = {"framework": "torch", "steps": [{"loss": 2.0}, {"loss": 1.1}]}
      >>> [round(x, 3) for x in self_divergence([noisy], {"torch": main})]
      [0.0, 0.1]
    """
    return running_envelope(gaps(mains[run["framework"]], run) for run in noise)


def fmt_value(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "no finite value"
    return f"{x:.3g}{(' ' + unit) if unit else ''}"


def overall_status(verdicts: Sequence[Verdict]) -> str:
    """The outcome of a set of rows, one of four:

    - ``"FAIL"``: a verdict failed;
    - ``"NOTHING COMPARED"``: no torch/JAX pair was compared;
    - ``"PASS"``: nothing failed, nothing exceeded its band (`EXCEEDED` rows: excused, not
      failed) and every compared cell has a decisive check (`is_decisive`: a pass with power,
      past step 0);
    - ``"INCONCLUSIVE"``: nothing failed, but some compared cell has a row that exceeded its
      band or no decisive check (only step 0, rows without power, informational rows): see
      `cell_bottom_lines` for the cause and the command that would decide.

    Example:
      >>> overall_status([])
      'NOTHING COMPARED'
    """
    if any(v.passed is False for v in verdicts):
        return "FAIL"
    compared = {v.cell for v in verdicts if v.mode not in _NOT_COMPARED}
    if not compared or not any(v.passed is True for v in verdicts):
        return "NOTHING COMPARED" if not _judged(verdicts) else "INCONCLUSIVE"
    decided = {v.cell for v in verdicts if is_decisive(v)}
    decided -= {v.cell for v in verdicts if v.mode == EXCEEDED}
    return "PASS" if compared <= decided else "INCONCLUSIVE"


_NOT_COMPARED = ("nothing compared", "unsupported here")


def _judged(verdicts: Sequence[Verdict]) -> bool:
    """Something was compared and judged, passing or not (inconclusive rows count)."""
    return any(v.mode in ("inconclusive", EXCEEDED) for v in verdicts)


def _why_inconclusive(v: Verdict) -> str:
    bound = power_bound(v.kind)
    if v.power is not None and bound is not None and v.power > bound:
        return f"{v.check}: tolerance {fmt_value(v.power)} above the bound {fmt_value(bound)}"
    return f"{v.check}: undecided"


def cell_configs(
    runs: Sequence[Mapping[str, Any]],
) -> dict[tuple[str, str, str], Mapping[str, Any]]:
    """Each cell's main run's config (``(model, precision, device)`` -> the record's ``config``):
    what `deciding_command` reruns. Calibration runs (a ``variant``) and records without a
    config are passed over.

    Example:
      >>> cell_configs([{"model": "mlp", "precision": "fp32", "device": "cpu", "config": {"steps": 3}}])
      {('mlp', 'fp32', 'cpu'): {'steps': 3}}
    """
    configs: dict[tuple[str, str, str], Mapping[str, Any]] = {}
    for run in runs:
        if run.get("variant") or not run.get("config"):
            continue
        configs.setdefault(
            (run.get("model"), run.get("precision"), run.get("device")), run["config"]
        )
    return configs


def cell_bottom_lines(
    verdicts: Sequence[Verdict],
    configs: Mapping[tuple[str, str, str], Mapping[str, Any]] | None = None,
) -> dict[tuple[str, str, str], str]:
    """One parity sentence per cell: PASS naming its decisive check (and, when its decisive
    per-step rows stop at the noise horizon, the steps it covers: ``PASS on steps 0-K only``),
    FAIL naming the first failing one, or INCONCLUSIVE naming the first row that exceeded its
    band (excused, not failed), else what lacked power, and the command that would decide
    (`deciding_command`: with the cell's run config from `configs`, where given, that run's
    settings).

    Example:
      >>> cell_bottom_lines([])
      {}
    """
    return {cell: text for cell, (_, text) in _cell_outcomes(verdicts, configs).items()}


def _cell_outcomes(
    verdicts: Sequence[Verdict],
    configs: Mapping[tuple[str, str, str], Mapping[str, Any]] | None = None,
) -> dict[tuple[str, str, str], tuple[str, str]]:
    """Each cell's outcome (``"FAIL"``, ``"INCONCLUSIVE"``, ``"PASS"``, ``"PASS early"``: a PASS
    whose decisive per-step rows stop at the noise horizon, or ``"nothing judged"``) and its
    bottom line (`cell_bottom_lines`)."""
    cells: dict[tuple, list[Verdict]] = {}
    for v in verdicts:
        cells.setdefault(v.cell, []).append(v)
    out = {}
    for cell, rows in cells.items():
        failed = [v for v in rows if v.passed is False]
        passed = [v for v in rows if v.passed is True]
        decisive = [v for v in rows if is_decisive(v)]
        inconclusive = [v for v in rows if v.mode == "inconclusive"]
        exceeded = [v for v in rows if v.mode == EXCEEDED]
        command = deciding_command(cell, seeds_to_decide(rows), (configs or {}).get(cell))
        if failed:
            first = failed[0]
            where = (
                f" (first failing step {first.first_failing_step})"
                if first.first_failing_step is not None
                else ""
            )
            out[cell] = (
                "FAIL",
                (
                    f"parity FAIL: {first.check} — {first.value_text} against {first.tolerance_text}"
                    f"{where}{'; ' + first.mode if first.mode else ''}"
                    + (f"; {len(failed) - 1} more failing check(s)" if len(failed) > 1 else "")
                ),
            )
        elif exceeded:
            first = exceeded[0]
            where = (
                f", first at step {first.first_failing_step}"
                if first.first_failing_step is not None
                else ""
            )
            out[cell] = (
                "INCONCLUSIVE",
                (
                    f"parity INCONCLUSIVE: {first.check} exceeded its band ({first.value_text} "
                    f"against {first.tolerance_text}{where}) and is excused, not failed (its note "
                    "says why)"
                    + (f"; {len(exceeded) - 1} more such row(s)" if len(exceeded) > 1 else "")
                    + f"; to decide: {command}"
                ),
            )
        elif decisive:
            modes = sorted({v.mode for v in passed if v.mode and v.mode != "exact"})
            best = min(decisive, key=lambda v: math.inf if v.power is None else v.power)
            info = [
                v
                for v in rows
                if v.passed is None and v.mode == "informational" and v.kind == "scale"
            ]
            text = (
                f"parity PASS: {len(passed)} checks"
                + (f", decided by {', '.join(modes)}" if modes else "")
                + f"; decisive after step 0: {best.check}"
                + (
                    f" (could detect a relative difference of {fmt_value(best.power)})"
                    if best.power is not None
                    else ""
                )
            )
            if inconclusive:
                text += f"; {len(inconclusive)} check(s) inconclusive (no power)"
            if info:
                text += (
                    "; the loss-scale trajectory was NOT tested (no skip, no growth: "
                    "informational, not a pass)"
                )
            depth = _pass_depth(rows, command)
            out[cell] = ("PASS early", f"{text}; {depth}") if depth else ("PASS", text)
        elif passed or inconclusive:
            lacking = "; ".join(_why_inconclusive(v) for v in inconclusive[:3])
            out[cell] = (
                "INCONCLUSIVE",
                (
                    "parity INCONCLUSIVE: nothing failed, but no check past step 0 decided"
                    + (f" ({lacking})" if lacking else " (only step 0 and informational rows)")
                    + f"; to decide: {command}"
                ),
            )
        else:
            reasons = sorted({v.detail or v.value_text for v in rows if v.passed is None})
            out[cell] = (
                "nothing judged",
                "nothing judged (never a pass): " + "; ".join(reasons)[:300],
            )
    return out


def _pass_depth(rows: Sequence[Verdict], command: str) -> str | None:
    """How deep a passing cell's PASS goes when its decisive per-step rows stop at a horizon
    (None when a decisive row covers every step): a PASS decided by ``per-step loss, steps 0-1
    (horizon)`` says that two steps agree, not that the run does. The steps beyond are the
    per-step rows (`parity.verdicts.checks.Check.per_step`) whose tolerance, the model's own
    divergence, is above their bound."""
    windows = [v for v in rows if check_of(v.kind).per_step and v.window is not None]
    covered = [v.window[1] - 1 for v in windows if is_decisive(v)]
    beyond = [
        v
        for v in windows
        if v.passed is not True and v.power is not None and v.power > power_bound(v.kind)
    ]
    if not covered or not beyond:
        return None
    depth = max(covered)
    start = min(v.window[0] for v in beyond)
    stop = max(v.window[1] - 1 for v in beyond)
    if depth >= start:  # a decisive row covers those steps too
        return None
    return (
        f"PASS on steps 0-{depth} only: from step {start} to {stop} the model's own noise "
        f"exceeds the bound ({', '.join(v.check for v in beyond)}: inconclusive); more "
        f"data orders decide more: {command}"
    )


def seeds_to_decide(rows: Sequence[Verdict | Row]) -> int:
    """The tolerance table's ``deciding_seeds``, or more where an undecided seed-statistics
    row says how many seeds its observed spread needs (`Verdict.seeds_needed`; the fewest of
    its rows: one decides)."""
    needed = [v.seeds_needed for v in rows if v.seeds_needed is not None]
    least = TOLERANCES["deciding_seeds"]
    return max(least, min(needed, default=least))


def verdict_mark(v: Verdict) -> str:
    """``"pass"``, ``"FAIL"``, ``"exceeded"`` (exceeded its band, excused, undecided),
    ``"inconclusive"`` (no power) or ``"info"``."""
    if v.passed is None:
        if v.mode == EXCEEDED:
            return "exceeded"
        return "inconclusive" if v.mode == "inconclusive" else "info"
    return "pass" if v.passed else "FAIL"


def format_verdicts(
    verdicts: list[Verdict], configs: Mapping[tuple[str, str, str], Mapping[str, Any]] | None = None
) -> str:
    """A plain-text table for the terminal, then the explanation of every failing row and each
    undecided cell's deciding command, or a passing cell's bottom line when its PASS covers the
    first steps only (`cell_bottom_lines`; its run's settings from `configs`, `cell_configs` of
    the runs, where given)."""
    header = ("model", "precision", "device", "check", "compared", "value", "tolerance")
    rows = [(*header, "mode", "verdict")]
    for v in verdicts:
        cells = (v.model, v.precision, v.device, v.check, v.compared, v.value_text)
        rows.append((*cells, v.tolerance_text, v.mode, verdict_mark(v)))
    widths = [min(max(len(r[i]) for r in rows), 48) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell[:48].ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    ]
    failed = [v for v in verdicts if v.passed is False]
    passed = sum(v.passed is True for v in verdicts)
    for v in failed:
        lines.append(f"FAIL {v.model} {v.precision} {v.check}: {v.detail}")
    status = overall_status(verdicts)
    exceeded = [v for v in verdicts if v.mode == EXCEEDED]
    for v in exceeded:
        lines.append(
            f"EXCEEDED (not failed, undecided) {v.model} {v.precision} {v.check}: {v.detail}"
        )
    inconclusive = sum(v.mode == "inconclusive" for v in verdicts)
    lines.append(
        f"{passed} passed, {len(failed)} failed, {len(exceeded)} exceeded (excused, undecided), "
        f"{inconclusive} inconclusive (no power): {status}"
    )
    if status in ("INCONCLUSIVE", "PASS"):  # undecided cells, and a PASS that ends early
        for cell, (outcome, text) in _cell_outcomes(verdicts, configs).items():
            if outcome in ("INCONCLUSIVE", "PASS early"):
                lines.append(f"{' '.join(cell)}: {text}")
    if status == "NOTHING COMPARED":
        lines.append(
            "no torch/JAX pair was compared (need both frameworks with the same data seed)"
        )
    return "\n".join(lines)


def signal_gaps(ref, cand, field) -> list[float] | None:
    """Per step, the relative gap of a recorded signal (``grad_norm``, ``update_norm``) between
    two runs: 0 where both skipped, inf where only one did or a value is missing; None when
    either run never recorded it.

    Example:
      >>> signal_gaps({"steps": [{"grad_norm": 2.0}]}, {"steps": [{"grad_norm": 2.2}]}, "grad_norm")
      [0.10000000000000009]
    """
    a = [s.get(field) for s in ref["steps"]]
    b = [s.get(field) for s in cand["steps"]]
    if not any(isinstance(x, int | float) for x in a) or not any(
        isinstance(x, int | float) for x in b
    ):
        return None
    out = []
    for x, y, ra, rb in zip(a, b, ref["steps"], cand["steps"], strict=False):
        if ra.get("skipped") or rb.get("skipped"):
            out.append(0.0 if ra.get("skipped") == rb.get("skipped") else math.inf)
        elif x is None or y is None:
            out.append(math.inf)
        else:
            out.append(abs(x - y) / max(abs(x), 1e-30))
    return out
