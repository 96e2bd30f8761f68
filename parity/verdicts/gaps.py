"""The numbers a trained pair's rows are made of: each run's losses, the per-step relative gaps
between two runs with their floor, the mean of the last losses, a recorded signal's gaps, and the
self-divergence envelope (the running maximum of a calibration run's gap to its own framework's
main run).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from parity.verdicts.tolerances import TOLERANCES

__all__ = [
    "final_mean",
    "loss_floor",
    "loss_gaps",
    "relative_gaps",
    "run_losses",
    "running_envelope",
    "self_divergence",
    "signal_gaps",
]


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
