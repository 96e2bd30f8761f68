"""Verdict rows and the numbers they are made of: one `Verdict` per check, the fixed bands
(`TOLERANCES`), per-step relative gaps with their floor, the self-divergence envelope, and what
is said about a set of rows (`overall_status`, `cell_bottom_lines`, `format_verdicts`).
`parity.compare` makes the rows; `parity.step0`, the distributed runner and the report use them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "LOSS_UNIT",
    "TOLERANCES",
    "Verdict",
    "cell_bottom_lines",
    "compared_pairs",
    "final_mean",
    "fmt_value",
    "format_verdicts",
    "loss_floor",
    "overall_status",
    "relative_gaps",
    "run_losses",
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
    ref = run_losses(main)
    floor = loss_floor(ref)
    envelope = None
    for run in noise_runs:
        gaps = relative_gaps(ref, run_losses(run), floor)
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


def fmt_value(x: float | None, unit: str = "") -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "no finite value"
    return f"{x:.3g}{(' ' + unit) if unit else ''}"


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
