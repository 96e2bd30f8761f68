"""A verdict row: one `Verdict` per check (frozen), the `Row` a judging pass builds before it
is frozen, and what a row's power is measured against (`power_bound`, `is_decisive`). The
numbers rows are made of are `parity.verdicts.gaps`; what is said about a set of rows is
`parity.verdicts.outcomes`. `parity.verdicts.judge` makes a trained pair's rows;
`parity.verdicts.step0`, the distributed runner and the report use them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from parity.verdicts.checks import check_of
from parity.verdicts.tolerances import POWER_BOUNDS

__all__ = [
    "EXCEEDED",
    "LOSS_UNIT",
    "PADDING_CHECK",
    "cell_fields",
    "fmt_value",
    "is_decisive",
    "no_power_note",
    "power_bound",
    "Row",
    "stated_power",
    "Verdict",
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


def fmt_value(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "no finite value"
    return f"{x:.3g}{(' ' + unit) if unit else ''}"
