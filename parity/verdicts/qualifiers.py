"""The one ordered list of qualifiers: each turns a judged row of a trained pair undecided
(``passed`` None) for one stated reason, before the row is frozen into a `Verdict`.

Two outcomes come out of them. A row whose tolerance is above its power bound passed without
power: ``"inconclusive"``. A row that **exceeded** its band with power, and whose failure one
reason excuses (no band calibrated to the model's own chaos past step 30, a structural
difference of the two models, a departure from the rounding floor), is ``"exceeded"``: never a
FAIL, and never inside a PASS either (`parity.verdicts.outcomes.overall_status`): its cell is
INCONCLUSIVE with the command that would decide it.

A qualifier is a predicate on a `Row` and its pair's context (`Pair`, `parity.verdicts.judge`)
with the reason it adds to the row's detail and the mode it gives the row. They are applied in
`QUALIFIERS`' order; a row's identity is its ``kind`` and ``window``, never its label.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from parity.verdicts.checks import CHECKS
from parity.verdicts.rows import EXCEEDED, Row, Verdict, no_power_note
from parity.verdicts.tolerances import TOLERANCES

__all__ = [
    "ADAPTIVE_UPDATE_NOTE",
    "NO_PAIR_NOTE",
    "QUALIFIERS",
    "Qualifier",
    "UNCALIBRATED_FLIP_NOTE",
    "UNCALIBRATED_NOTE",
    "escalation",
    "qualify",
    "verdict",
]

CHAOS_STEP = TOLERANCES["chaos_step"]


UNCALIBRATED_NOTE = (
    f"exceeded, not failed: from step {CHAOS_STEP} on, no band is calibrated to this "
    "model's own float32 divergence (a correct port's gap grows by chaotic amplification); "
    "decide with --noise torch (self-divergence) or seed statistics (equivalence: the seeds "
    "the cell's deciding command names)"
)

# AdamW divides each element's moment by its own magnitude: an element whose gradient is zero in
# exact arithmetic but rounding noise in floats (a bias before a BatchNorm, a padded row) moves by
# up to lr * |g| / (|g| + eps) either way, so the update norm measures rounding there, not the port.
ADAPTIVE_UPDATE_NOTE = (
    "informational under AdamW: each element's step is its gradient over its own magnitude, so "
    "parameters whose exact gradient is zero (a bias before BatchNorm) move by rounding noise "
    "and set the update norm; judged under SGD"
)

UNCALIBRATED_FLIP_NOTE = (
    f"exceeded, not failed: from step {CHAOS_STEP} on, float16's 4-ulp flip window assumes the "
    "two sides still agree to rounding, while a correct port's gradient maxima part by chaotic "
    "amplification; no noise run measured how far this model's own move by then: decide with "
    "--noise torch (the window becomes twice that spread)"
)

WELCH_NOTE = "a difference test that does not reject proves nothing: the equivalence row decides"

NO_PAIR_NOTE = "informational: no trained torch/JAX pair in this cell to judge"

# Row kinds (`parity.verdicts.checks.CHECKS`) each qualifier looks at.
_PER_STEP = tuple(kind for kind, check in CHECKS.items() if check.per_step)
_LOGITS = ("logit kl", "logit top1")  # one eval point each, past the chaos step or not
_STRUCTURAL = (*_PER_STEP, "final loss", "welch loss", "equivalence loss")
_DEPARTURE = ("loss", "grad norm", "final loss")


@dataclasses.dataclass(frozen=True)
class Qualifier:
    """One reason a judged row decides nothing.

    Attributes:
      name: what it is, e.g. ``"no power"``.
      applies: ``(row, pair) -> bool``.
      note: ``(row, pair) -> str``: the reason added to the row's detail.
      mode: the mode the row gets (``"inconclusive"``, ``"informational"``), or None to keep its own.
      remedy: what decides a row it excuses: ``"noise"`` (a 1-ulp calibration run, which the
        harness runs itself: `escalation`), ``"seeds"``, or ``""``.
      judges: which rows it judges, and so what its second argument is: ``"pair"`` a trained
        pair's rows (the pair's context, `parity.verdicts.judge.Pair`); ``"made"`` rows made
        outside a judging pass (step 0's gate, a distributed run's own checks: `verdict`; None);
        ``"stored"`` the rows a run record stores, judged in their cell (whether the cell has a
        trained comparable pair).
    """

    name: str
    applies: Callable[[Row, Any], bool]
    note: Callable[[Row, Any], str]
    mode: str | None
    remedy: str = ""
    judges: tuple[str, ...] = ("pair",)


def _no_power_note(row: Row, pair: Any) -> str:
    return no_power_note(row.stated_power(), row.kind)


def _no_power(row: Row, pair: Any) -> bool:
    power, bound = row.stated_power(), row.bound()
    return row.passed is True and power is not None and bound is not None and not power <= bound


def _uncalibrated(row: Row, pair: Any) -> bool:
    past_chaos = row.kind in _LOGITS or (
        row.kind in _PER_STEP and row.window is not None and row.window[0] >= CHAOS_STEP
    )
    return past_chaos and row.split_at_chaos and row.passed is False


def _uncalibrated_flip(row: Row, pair: Any) -> bool:
    return (
        row.kind == "skips"
        and row.passed is False
        and not pair.calibrated
        and row.first_failing_step is not None
        and row.first_failing_step >= CHAOS_STEP
    )


def _structural(row: Row, pair: Any) -> bool:
    return (
        bool(pair.structural)
        and row.passed is False
        and row.kind in _STRUCTURAL
        and (row.first_failing_step is None or row.first_failing_step > 0)
    )


def _departure(row: Row, pair: Any) -> bool:
    departure = pair.departure
    return (
        departure is not None
        and row.passed is False
        and row.kind in _DEPARTURE
        and (row.first_failing_step is None or row.first_failing_step >= departure[0])
    )


QUALIFIERS: tuple[Qualifier, ...] = (
    Qualifier("no power", _no_power, _no_power_note, "inconclusive", judges=("pair", "made")),
    Qualifier(
        "uncalibrated chaos", _uncalibrated, lambda row, pair: UNCALIBRATED_NOTE, EXCEEDED, "noise"
    ),
    Qualifier(
        "uncalibrated flip window",
        _uncalibrated_flip,
        lambda row, pair: UNCALIBRATED_FLIP_NOTE,
        EXCEEDED,
        "noise",
    ),
    Qualifier(
        "adaptive update",
        lambda row, pair: row.kind == "update norm" and pair.adaptive,
        lambda row, pair: ADAPTIVE_UPDATE_NOTE,
        "informational",
    ),
    Qualifier(
        "seed statistics decide",
        lambda row, pair: row.kind in ("welch loss", "welch eval"),
        lambda row, pair: WELCH_NOTE,
        "informational",
    ),
    Qualifier(
        "structural difference",
        _structural,
        lambda row, pair: "; ".join(s.reason for s in pair.structural),
        EXCEEDED,
        "seeds",
    ),
    Qualifier(
        "rounding departure", _departure, lambda row, pair: pair.departure[1], EXCEEDED, "seeds"
    ),
    Qualifier(
        "no trained pair",
        lambda row, judged: row.passed is True and not judged,
        lambda row, judged: NO_PAIR_NOTE,
        None,
        judges=("stored",),
    ),
)


def qualify(row: Row, context: Any, rows: str = "pair") -> Row:
    """`row` with every qualifier of `QUALIFIERS` that judges `rows` (`Qualifier.judges`) and
    applies, in order: ``passed`` None, the qualifier's mode, its reason appended to the detail.
    Changes `row` in place and returns it. `context`: a trained pair's (``rows="pair"``), None
    (``"made"``), or whether the cell has a trained pair (``"stored"``)."""
    for q in QUALIFIERS:
        if rows in q.judges and q.applies(row, context):
            note = q.note(row, context)
            row.passed = None
            if q.mode is not None:
                row.mode = q.mode
            row.detail = f"{row.detail}; {note}" if row.detail else note
            row.qualified.append(q.name)
    return row


def verdict(
    model: str,
    precision: str,
    device: str,
    check: str,
    compared: str,
    value: Any,
    tolerance: Any,
    passed: bool | None,
    *,
    kind: str,
    **fields: Any,
) -> Verdict:
    """A row made outside a trained pair's judging pass (step 0's gate, a distributed run's own
    checks, a replay, the data check), judged by the qualifiers that read no pair (a pass
    without power is inconclusive) and frozen: `Verdict`'s fields, `kind` required.

    Example:
      >>> v = verdict("m", "fp32", "cpu", "step 0 fp32: gradients", "jax vs torch", 0.5, 3.25,
      ...             True, kind="step 0 gradients", mode="step 0")
      >>> v.passed, v.mode, v.power
      (None, 'inconclusive', 3.25)
    """
    row = qualify(Row(kind, check, value, tolerance, passed, **fields), None, "made")
    return row.freeze(
        {"model": model, "precision": precision, "device": device, "compared": compared}
    )


def escalation(verdicts) -> bool:
    """Whether a 1-ulp torch calibration run would decide rows these verdicts leave undecided:
    a row exceeded its band and the qualifier that excused it names a noise run as its remedy
    (``Verdict.qualified_by``). The harness then runs it itself (`parity.cell.run_cell`'s
    ``escalate``), within a budget of one torch training run per cell.

    Example:
      >>> escalation([])
      False
    """
    noise = {q.name for q in QUALIFIERS if q.remedy == "noise"}
    return any(v.mode == EXCEEDED and v.qualified_by in noise for v in verdicts)
