"""What is said about a set of verdict rows: the outcome (`overall_status`: FAIL, PASS,
INCONCLUSIVE, NOTHING COMPARED), each cell's bottom line (`cell_bottom_lines`) with the command
that would decide an undecided cell (`deciding_command`), and the terminal table
(`format_verdicts`).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from parity.core.flags import run_arguments
from parity.verdicts.checks import check_of
from parity.verdicts.rows import EXCEEDED, Row, Verdict, fmt_value, is_decisive, power_bound
from parity.verdicts.tolerances import TOLERANCES

__all__ = [
    "cell_bottom_lines",
    "cell_configs",
    "deciding_command",
    "format_verdicts",
    "overall_status",
    "seeds_to_decide",
    "verdict_mark",
]


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
