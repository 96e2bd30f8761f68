"""Tolerances and verdicts: does the JAX run train like the torch run?

For every (model, precision, device) with a torch run and a JAX run (each torch mode — eager and
torch.compile — is compared with JAX separately):

- all precisions: ``no divergence`` — neither run has a non-finite loss (fails otherwise; the run
  is still recorded and reported).
- ``fp32``: per-step loss within 1e-4 relative for steps 0-9 and within 1e-3 for steps 10-29.
- ``fp16-mixed``: identical loss-scale trajectory and identical skip decisions, step for step;
  final loss within 5%.
- ``bf16-mixed`` and ``bf16-true``: final loss within 5% relative. The final loss is the mean over
  the last 5 steps (both sides see the same batches, so this only damps single-batch noise). The
  difference is divided by ``max(torch final loss, 1% of torch's first loss)``: once a run has
  trained its loss to ~0, the relative difference of two tiny numbers is rounding noise (a loss
  of 0.0029 vs 0.0031 is not a 7% disagreement about training).
- informational (never fails): max per-step relative loss difference over the whole run, eval
  metric difference.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from parity.records import run_label

__all__ = ["TOLERANCES", "Verdict", "compare_runs", "format_verdicts"]

TOLERANCES = {
    "fp32_first": (10, 1e-4),  # (steps, relative tolerance)
    "fp32_next": (30, 1e-3),
    "final_loss_rel": 0.05,
    "final_window": 5,
    "final_loss_floor_frac": 0.01,  # of the first loss: the denominator's floor
}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One check of one torch/JAX pair. `passed` is None for informational rows."""

    model: str
    precision: str
    device: str
    check: str
    compared: str
    value: Any
    tolerance: Any
    passed: bool | None
    detail: str = ""

    @property
    def value_text(self) -> str:
        if isinstance(self.value, float):
            return f"{self.value:.3g}"
        return str(self.value)

    @property
    def tolerance_text(self) -> str:
        if isinstance(self.tolerance, float):
            return f"{self.tolerance:.0e}" if self.tolerance < 0.01 else f"{self.tolerance:.0%}"
        return str(self.tolerance)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _rel(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        return math.inf
    return abs(a - b) / max(abs(a), 1e-12)


def _final(run: dict[str, Any], window: int) -> float | None:
    losses = [s["loss"] for s in run["steps"][-window:]]
    if not losses or any(x is None for x in losses):
        return None
    return sum(losses) / len(losses)


def _pair_verdicts(ref: dict[str, Any], cand: dict[str, Any]) -> list[Verdict]:
    compared = f"{run_label(cand)} vs {run_label(ref)}"
    base = {
        "model": ref["model"],
        "precision": ref["precision"],
        "device": ref["device"],
        "compared": compared,
    }
    out: list[Verdict] = []

    def add(check, value, tolerance, passed, detail=""):
        out.append(
            Verdict(
                check=check, value=value, tolerance=tolerance, passed=passed, detail=detail, **base
            )
        )

    errors = [
        f"{run_label(r)}: {r['summary']['error']}" for r in (ref, cand) if r["summary"].get("error")
    ]
    if errors:
        add("run completed", "; ".join(errors), "no error", False)
        return out
    bad = []
    for run in (ref, cand):
        s = run["summary"]
        if s.get("diverged"):
            bad.append(f"{run_label(run)} at step {s.get('first_nonfinite_step')}")
    add(
        "no divergence",
        "diverged: " + ", ".join(bad) if bad else "all losses finite",
        "finite",
        not bad,
    )
    n = min(len(ref["steps"]), len(cand["steps"]))
    rels = [_rel(ref["steps"][i]["loss"], cand["steps"][i]["loss"]) for i in range(n)]
    precision = ref["precision"]
    window = TOLERANCES["final_window"]
    if precision == "fp32":
        start = 0
        for name in ("fp32_first", "fp32_next"):
            stop, tol = TOLERANCES[name]
            segment = rels[start : min(stop, n)]
            if segment:
                worst = max(segment)
                at = start + segment.index(worst)
                add(
                    f"per-step loss, steps {start}-{min(stop, n) - 1}",
                    worst,
                    tol,
                    worst <= tol,
                    f"max relative difference at step {at}",
                )
            start = stop
    elif precision == "fp16-mixed":
        scales_ref = [s["loss_scale"] for s in ref["steps"][:n]]
        scales_cand = [s["loss_scale"] for s in cand["steps"][:n]]
        diff = [i for i in range(n) if scales_ref[i] != scales_cand[i]]
        add(
            "loss-scale trajectory",
            "identical" if not diff else f"differs from step {diff[0]}",
            "identical",
            not diff and n > 0,
            f"{n} steps; final scale {scales_ref[-1] if n else None}",
        )
        skips_ref = [s["skipped"] for s in ref["steps"][:n]]
        skips_cand = [s["skipped"] for s in cand["steps"][:n]]
        diff = [i for i in range(n) if skips_ref[i] != skips_cand[i]]
        add(
            "skip decisions",
            f"identical ({sum(skips_ref)} skipped)" if not diff else f"differ at steps {diff[:5]}",
            "identical",
            not diff and n > 0,
        )
    if precision != "fp32":
        a, b = _final(ref, window), _final(cand, window)
        first = ref["steps"][0]["loss"] if ref["steps"] else None
        floor = TOLERANCES["final_loss_floor_frac"] * abs(first) if first else 0.0
        value = math.inf if a is None or b is None else abs(a - b) / max(abs(a), floor, 1e-12)
        add(
            f"final loss (mean of last {window})",
            value,
            TOLERANCES["final_loss_rel"],
            value <= TOLERANCES["final_loss_rel"],
            f"{run_label(ref)} {a}, {run_label(cand)} {b}",
        )
    if rels:
        finite = [r for r in rels if math.isfinite(r)]
        add(
            "max per-step loss difference (all steps)",
            max(finite) if finite else math.inf,
            "—",
            None,
        )
    ea, eb = ref["summary"].get("eval_metric"), cand["summary"].get("eval_metric")
    if ea is not None and eb is not None:
        add(
            f"eval {ref['summary'].get('eval_metric_name', 'metric')}: {run_label(ref)} {ea:.4g}, {run_label(cand)} {eb:.4g}",
            abs(ea - eb),
            "—",
            None,
        )
    return out


def compare_runs(runs: list[dict[str, Any]]) -> list[Verdict]:
    """Verdicts for every torch/JAX pair among `runs` (grouped by model, precision, device)."""
    groups: dict[tuple, list] = {}
    for run in runs:
        groups.setdefault((run["model"], run["precision"], run["device"]), []).append(run)
    verdicts: list[Verdict] = []
    for key in sorted(groups):
        members = groups[key]
        torch_runs = sorted((r for r in members if r["framework"] == "torch"), key=run_label)
        jax_runs = [r for r in members if r["framework"] == "jax"]
        if not torch_runs or not jax_runs:
            present = ", ".join(run_label(r) for r in members)
            verdicts.append(
                Verdict(
                    *key,
                    check="pair",
                    compared=present,
                    value="only " + present,
                    tolerance="torch and jax",
                    passed=None,
                )
            )
            continue
        for ref in torch_runs:
            for cand in jax_runs:
                verdicts.extend(_pair_verdicts(ref, cand))
    return verdicts


def format_verdicts(verdicts: list[Verdict]) -> str:
    """A plain-text table for the terminal."""
    rows = [("model", "precision", "device", "check", "compared", "value", "tolerance", "verdict")]
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
                mark,
            )
        )
    widths = [min(max(len(r[i]) for r in rows), 48) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell[:48].ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
    ]
    failed = sum(v.passed is False for v in verdicts)
    passed = sum(v.passed is True for v in verdicts)
    lines.append(f"{passed} passed, {failed} failed")
    return "\n".join(lines)
