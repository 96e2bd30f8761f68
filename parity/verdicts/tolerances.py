"""Every constant a trained pair's verdict uses, in one table, each with the reason for its value;
and the per-step loss tolerance built from them (`step_band`, `envelope_ratio`,
`step_tolerances`).

`CONSTANTS` maps a name to a `Constant` (value and a one-line reason); `TOLERANCES` is the same
table's values, read-only, which is what the judging code reads.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CONSTANTS",
    "Constant",
    "POWER_BOUNDS",
    "TOLERANCES",
    "envelope_ratio",
    "step_band",
    "step_tolerances",
]


@dataclasses.dataclass(frozen=True)
class Constant:
    """A verdict constant: its value and, in one line, why it is that value."""

    value: Any
    reason: str


CONSTANTS: Mapping[str, Constant] = types.MappingProxyType(
    {
        "fp32_first": Constant(
            (10, 1e-4),
            "(steps, relative band): the first steps of an fp32 pair hold the same weights up to "
            "a few updates, so float32 rounding of the loss sum is all that may differ",
        ),
        "fp32_next": Constant(
            (30, 1e-3),
            "(steps, relative band): by step 30 rounding has been amplified by ~10 AdamW updates; "
            "the band after step 29 stays 1e-3",
        ),
        "final_loss_rel": Constant(
            0.05,
            "below fp32 the two sides round differently every step; 5% of the final loss is what "
            "a correct bf16/fp16 port stays within on the built-in models",
        ),
        "final_window": Constant(5, "losses averaged at the end: one noisy batch does not decide"),
        "final_loss_floor_frac": Constant(
            0.01,
            "of the first loss: the relative gap's denominator floor, so a loss trained to ~0 "
            "does not make a meaningless 100% gap",
        ),
        "noise_k": Constant(
            10.0,
            "the cross-framework gap may be this many times the model's own 1-ulp divergence: two "
            "implementations differ by more than one ulp per operation",
        ),
        "noise_floor": Constant(
            2.0**-24,
            "smallest self-divergence credited at step 0: a float32 half-ulp",
        ),
        "noise_lag": Constant(
            2,
            "steps the envelope is read ahead: a 1-ulp nudge crosses a rounding threshold a step "
            "or two after the larger cross-framework differences do",
        ),
        "seed_confidence": Constant(0.95, "Welch's t-test level (informational row)"),
        "seed_accuracy_floor": Constant(
            0.01, "absolute floor of an accuracy difference in the Welch row"
        ),
        "seed_margin_loss": Constant(
            0.05,
            "equivalence margin of the final loss over seeds, relative to torch's mean: the "
            "final-loss band a single run is held to",
        ),
        "seed_margin_accuracy": Constant(
            0.02,
            "equivalence margin of accuracy over seeds, absolute: what 5 seeds of the built-in "
            "synthetic sets resolve",
        ),
        "seed_alpha": Constant(0.05, "level of each one-sided test of the equivalence (TOST)"),
        "power_bound_loss": Constant(
            0.2,
            "largest loss tolerance that still decides: the built-in pairs' losses fall 30-60% "
            "over a short run, and 20% is 4x the final-loss band",
        ),
        "power_bound_norm": Constant(
            0.2, "gradient and update norms summarise a step as a loss does: the same bound"
        ),
        "power_bound_relative_error": Constant(
            1.0,
            "a normwise relative error of 1 is what an all-zero result scores: a band at or above "
            "it passes a model that computes nothing",
        ),
        "signal_factor": Constant(
            10.0,
            "gradient and update norms amplify rounding more than the loss (a norm over every "
            "gradient, each a difference of large terms): held to this many loss tolerances",
        ),
        "chaos_step": Constant(
            30,
            "from this step on an uncalibrated fixed band cannot tell the model's chaotic growth "
            "of rounding from a port bug: its failure is undecided, never a FAIL",
        ),
        "fp8_step_band": Constant(
            2.0**-4,
            "after step 0 of an fp8 pair: a summation-order flip moves an e4m3 code by one step, "
            "about e4m3's unit roundoff",
        ),
        "fp16_flip_ulps": Constant(
            4,
            "a differing skip with both sides within this many float16 ulps of float16's max is a "
            "rounding flip, not a port difference",
        ),
        "fp16_flip_noise_k": Constant(
            2.0,
            "with a calibration run the flip window is this many times the model's own spread of "
            "gradient maxima: each correct side sits about that far from the exact value",
        ),
        "fp16_max": Constant(65504.0, "float16's largest finite value"),
        "deciding_seeds": Constant(
            5, "data seeds per framework the deciding command asks for at the least"
        ),
        "top_k": Constant(5, "the top-k overlap reported beside top-1 agreement of eval logits"),
    }
)

TOLERANCES: Mapping[str, Any] = types.MappingProxyType(
    {name: c.value for name, c in CONSTANTS.items()}
)

# The power bound of each quantity a check compares (`parity.verdicts.checks.Check.quantity`).
POWER_BOUNDS: Mapping[str, float] = types.MappingProxyType(
    {
        "loss": TOLERANCES["power_bound_loss"],
        "norm": TOLERANCES["power_bound_norm"],
        "relative error": TOLERANCES["power_bound_relative_error"],
        # an eval logit row is held to a relative logit difference taken from the loss rows'
        # tolerance (`parity.verdicts.logits`): the loss's bound
        "logit difference": TOLERANCES["power_bound_loss"],
    }
)


def step_band(step: int) -> float:
    """The fixed per-step loss band of `step` (1e-4 for steps 0-9, 1e-3 after).

    Example:
      >>> step_band(0), step_band(10)
      (0.0001, 0.001)
    """
    first_stop, first_tol = TOLERANCES["fp32_first"]
    return first_tol if step < first_stop else TOLERANCES["fp32_next"][1]


def envelope_ratio(gaps: Sequence[float], envelope: Sequence[float] | None) -> float:
    """How much `step_tolerances` scales a self-divergence `envelope` up: the step-0 gap over the
    envelope's first value (its floor at least), when that gap is within step 0's band; else 1.

    Example:
      >>> envelope_ratio([2e-5, 0.0], [1e-5, 1e-4])
      2.0
    """
    if not envelope or not gaps:
        return 1.0
    step0 = gaps[0]
    if not math.isfinite(step0) or step0 > step_band(0):
        return 1.0
    return max(1.0, step0 / max(envelope[0], TOLERANCES["noise_floor"]))


def step_tolerances(gaps: Sequence[float], envelope: Sequence[float] | None) -> list[float]:
    """The per-step loss tolerance of an fp32 pair: the fixed band of each step, or with a
    self-divergence `envelope` ``max(band(s), k * min(r * env(s + lag), max env))`` from step 1
    on (``r`` rescales the envelope to the step-0 gap: `envelope_ratio`).

    Example:
      >>> step_tolerances([0.0, 0.0], None)
      [0.0001, 0.0001]
    """
    out = []
    k, lag = TOLERANCES["noise_k"], TOLERANCES["noise_lag"]
    ratio = envelope_ratio(gaps, envelope)
    saturation = max((e for e in envelope or () if math.isfinite(e)), default=0.0)
    for s in range(len(gaps)):
        noise = 0.0
        if envelope and s > 0:
            noise = k * min(ratio * envelope[min(s + lag, len(envelope) - 1)], saturation)
        out.append(max(step_band(s), noise))
    return out
