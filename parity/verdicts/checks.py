"""The checks of a trained torch/JAX pair, as a table: each row kind, the series it compares,
its tolerance rule and its quantity (which power bound applies:
`parity.verdicts.tolerances.POWER_BOUNDS`). A row's identity is its kind (`Verdict.kind`) and the
steps it covers, never its label. `parity.verdicts.builders` makes the rows of each kind.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CHECKS", "Check", "UNCLASSIFIED", "check_of"]


@dataclasses.dataclass(frozen=True)
class Check:
    """One kind of row.

    Attributes:
      kind: its name (`Verdict.kind`).
      series: what it compares.
      rule: its tolerance rule.
      quantity: which power bound applies (`parity.verdicts.tolerances.POWER_BOUNDS`).
      decisive: a pass of this kind, with power, can make its cell PASS; False for checks that
        can pass a wrong port whatever their figures (a run completed, its losses finite) and
        for rows that only say something about the runs.
      per_step: it compares a series step by step: its rows cover windows of steps.
      over_seeds: it compares statistics over the data seeds (its rows name the seed count).
    """

    kind: str
    series: str
    rule: str
    quantity: str
    decisive: bool = True
    per_step: bool = False
    over_seeds: bool = False


# A row stored before rows had kinds (read back from an old run record) has none: its tolerance
# is a relative error, and step 0's rows never decide a cell (their mode says so).
UNCLASSIFIED = Check("", "a row stored without a kind", "its own", "relative error")


CHECKS: dict[str, Check] = {
    c.kind: c
    for c in (
        Check("completed", "run status", "exact", "relative error", decisive=False),
        Check("divergence", "loss finiteness", "exact", "relative error", decisive=False),
        Check("left out", "calibration run settings", "informational", "relative error"),
        Check("loss", "per-step loss", "fixed band or calibrated envelope", "loss", per_step=True),
        Check("fp8 loss", "per-step loss, steps 0-9", "fixed band", "loss", per_step=True),
        Check("scale", "loss scale from each side's own skips", "GradScaler's rule, exact", "loss"),
        Check(
            "skips",
            "skip decisions",
            "identical, or apart within the flip window",
            "relative error",
        ),
        Check("final loss", "mean of the last losses", "fixed band or calibrated envelope", "loss"),
        Check("max gap", "per-step loss over the run", "informational", "loss"),
        Check("eval", "eval metric", "informational", "relative error"),
        Check(
            "grad norm",
            "per-step gradient norm",
            "fixed band or calibrated envelope",
            "norm",
            per_step=True,
        ),
        Check(
            "update norm",
            "per-step update norm",
            "fixed band or calibrated envelope",
            "norm",
            per_step=True,
        ),
        Check("welch loss", "final loss over seeds", "difference test", "loss", over_seeds=True),
        Check(
            "welch eval",
            "eval metric over seeds",
            "difference test",
            "relative error",
            over_seeds=True,
        ),
        Check(
            "equivalence loss",
            "final loss over seeds",
            "equivalence margin",
            "loss",
            over_seeds=True,
        ),
        Check(
            "equivalence eval",
            "eval metric over seeds",
            "equivalence margin",
            "relative error",
            over_seeds=True,
        ),
        Check("logit tokens", "eval tokens sampled", "exact", "relative error"),
        Check("logit kl", "eval logits, per-token KL", "logit band", "logit difference"),
        Check("logit top1", "eval logits, top-1 agreement", "logit band", "logit difference"),
        Check("structural", "weight mapping and padding rows", "informational", "relative error"),
        Check(
            "replay optimizer",
            "the user's optimizers on identical gradients, per parameter and step",
            "float32 rounding: 8 eps of |p| + |update| + lr",
            "relative error",
        ),
        Check(
            "replay loss",
            "the user's losses on identical logits: values and gradients",
            "the dtype's rounding: 8 eps",
            "relative error",
        ),
        *(
            Check(kind, series, rule, "relative error", decisive=False)
            for kind, series, rule in (
                (
                    "step 0 output",
                    "step-0 outputs: logits, loss, running statistics",
                    "step-0 band",
                ),
                ("step 0 gradients", "step-0 gradients", "step-0 band"),
                ("layer probe", "each layer fed torch's input, on probe weights", "noise floor"),
                ("stochastic", "torch's train-mode forward, twice", "exact"),
                ("folded", "tensors the weight mapping sums", "informational"),
                ("dropout", "the two models' dropout rates", "informational"),
                ("compute dtype", "matmul/conv FLOPs in the compute dtype", "share of FLOPs"),
                ("quantized layers", "each quantized layer's scales and codes", "code steps"),
                ("optimizer state", "one optimizer step's state codes, scales, weights", "exact"),
                ("padding rows", "embedding rows torch never trains (step 0)", "informational"),
            )
        ),
        # What a cell holds besides checks: why nothing or not everything was compared.
        *(
            Check(kind, series, rule, "relative error", decisive=False)
            for kind, series, rule in (
                ("comparable", "the settings that shape the trajectory", "the same settings"),
                ("unsupported", "whether this hardware runs the cell", "informational"),
                ("pair", "a torch run and a JAX run of one data seed", "both present"),
                ("step 0 ran", "whether the step-0 checks ran", "they run"),
                ("data finite", "batch 0's inputs and targets", "finite"),
                ("jax mode", "the JAX modes a distributed arm runs", "informational"),
            )
        ),
        # A distributed run's own checks, one side each (`parity.distributed.run`).
        *(
            Check(kind, series, rule, "relative error")
            for kind, series, rule in (
                ("ranks agree", "loss scale and skips on every rank", "identical"),
                ("injected overflow", "the injected overflow's step on every rank", "skipped"),
                ("replicated params", "each replica's parameters", "bit-identical"),
                ("reduction dtype", "the gradient reduction's dtype", "the policy's"),
            )
        ),
    )
}


def check_of(kind: str) -> Check:
    """The `Check` of a row kind; `UNCLASSIFIED` for a row without one.

    Example:
      >>> check_of("grad norm").quantity, check_of("").quantity
      ('norm', 'relative error')
    """
    return CHECKS[kind] if kind else UNCLASSIFIED
