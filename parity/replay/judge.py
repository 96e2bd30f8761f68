"""Judging the optimizer replay and the loss replay into verdict rows, without torch: the torch
side is run here (`parity.replay.gradients`, `parity.replay.losses`) or read from a golden file
(`parity.replay.record`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from parity.replay.explain import ULPS, Finding, first_difference
from parity.replay.jax_side import SideStep, jax_replay
from parity.replay.losses import LossFinding
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import Verdict

__all__ = [
    "LOSS_CHECK",
    "OPTIMIZER_CHECK",
    "SCENARIOS",
    "ReplayResult",
    "judge_sequences",
    "loss_row",
    "optimizer_row",
]

OPTIMIZER_CHECK = "step 0 replay: optimizer on identical gradients"
LOSS_CHECK = "step 0 replay: loss on identical logits"
SCENARIOS = ("real", "tiny", "extremes", "non-finite")
EPS = float(np.finfo(np.float32).eps)


@dataclasses.dataclass
class ReplayResult:
    """What `replay_optimizers` found.

    Attributes:
      findings: ``{scenario: Finding or None}`` in the order replayed.
      steps: ``{scenario: steps replayed}``.
      seconds: the replay's wall time.
      table: per scenario and step, ``lr`` (torch; JAX where it exposes it), ``clip`` (torch's
        factor), ``skipped``, and the largest update difference over its tolerance.
    """

    findings: dict[str, Finding | None]
    steps: dict[str, int]
    seconds: float
    table: list[dict[str, Any]]

    @property
    def first(self) -> Finding | None:
        return next((f for f in self.findings.values() if f is not None), None)

    @property
    def passed(self) -> bool:
        return self.first is None


def judge_sequences(
    sequences: dict[str, tuple[list[SideStep], list[dict[str, np.ndarray]]]],
    stepper: tuple[Any, Any, Any],
    layout: Any,
    *,
    start: float | None = None,
) -> ReplayResult:
    """The JAX side (`parity.replay.jax_side.jax_stepper`) fed each sequence's gradients and
    judged against torch's steps (`parity.replay.explain.first_difference`).

    Args:
      sequences: ``{scenario: (torch's steps, the gradients fed, Flax layout)}``.
      stepper: the JAX side.
      layout: names torch's parameter behind a Flax leaf (``torch_name(s)``).
      start: when the replay began (`time.perf_counter`; default now).
    """
    start = time.perf_counter() if start is None else start
    findings: dict[str, Finding | None] = {}
    counts: dict[str, int] = {}
    table: list[dict[str, Any]] = []
    for name, (t_steps, flax_grads) in sequences.items():
        j_steps = jax_replay(stepper, flax_grads)
        findings[name] = first_difference(name, t_steps, j_steps, layout)
        counts[name] = len(t_steps)
        for k, (t, j) in enumerate(zip(t_steps, j_steps, strict=True)):
            lrs = sorted({float(v) for v in t.lr.values()})
            table.append(
                {
                    "scenario": name,
                    "step": k,
                    "lr_torch": lrs[0] if len(lrs) == 1 else lrs,
                    "lr_jax": j.lr,
                    "clip_torch": t.clip,
                    "skipped": [t.skipped, j.skipped],
                    "count": [t.count, j.count],
                }
            )
    return ReplayResult(findings, counts, time.perf_counter() - start, table)


def optimizer_row(result: ReplayResult, **base: Any) -> tuple[Verdict, dict[str, Any]]:
    """The optimizer replay's row and record; `base`: the row's ``model``, ``precision``,
    ``device``."""
    first = result.first
    sequences = ", ".join(f"{name} ({n} steps)" for name, n in result.steps.items())
    row = verdict(
        kind="replay optimizer",
        check=OPTIMIZER_CHECK,
        compared="the user's torch optimizer vs optax transformation, same gradients",
        value="agree" if first is None else f"{first.quantity} differs",
        tolerance=f"float32 rounding ({ULPS} eps of |p| + |update| + lr)",
        passed=first is None,
        detail=(first.message + "; " if first else "") + f"sequences: {sequences}",
        mode="step 0",
        first_failing_step=None if first is None else first.step,
        power=ULPS * EPS,
        **base,
    )
    record = {
        "findings": {k: (f.to_dict() if f else None) for k, f in result.findings.items()},
        "steps": result.table,
    }
    return row, record


def loss_row(
    finding: LossFinding | None, cases: list[dict], **base: Any
) -> tuple[Verdict, dict[str, Any]]:
    """The loss replay's row and record (`parity.replay.losses.compare_losses`'s result)."""
    row = verdict(
        kind="replay loss",
        check=LOSS_CHECK,
        compared="the user's torch loss vs JAX loss, same logits and targets",
        value="agree"
        if finding is None
        else (f"{finding.quantity} differs" if finding.decisive else "agree on this data"),
        tolerance=f"the dtype's rounding ({ULPS} eps)",
        passed=True if finding is None else (False if finding.decisive else None),
        detail=(finding.message + "; " if finding else "")
        + "cases: "
        + ", ".join(r["case"] for r in cases),
        mode="step 0",
        power=ULPS * EPS,
        **base,
    )
    return row, {"finding": finding.to_dict() if finding else None, "cases": cases}
