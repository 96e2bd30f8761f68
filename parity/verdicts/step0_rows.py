"""Step-0 verdict rows from two `parity.verdicts.sides.Side` records, without torch.

`stage_verdicts` turns one stage's torch and JAX numbers (float32, or the run's precision) into
the output and gradient rows with their bands (`parity.verdicts.tolerance`); `compute_verdicts`
says which dtype each side's matmul FLOPs ran in. `parity.verdicts.step0` calls them on sides it has just
computed, `parity.golden.check` on a torch side read from a golden file: one judgement for both.
"""

from __future__ import annotations

import math
from typing import Any

from parity.perf.flops import requested_fraction
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import Verdict, cell_fields
from parity.verdicts.sides import Side, pair_mapping
from parity.verdicts.tolerance import (
    LOW_PRECISION_GRADIENT_FACTOR,
    MIN_COMPUTE_FRACTION,
    SAFETY,
    gradient_tolerance,
    group_errors,
    relative_error,
    tolerance,
    unit_roundoff,
)

__all__ = ["compute_verdicts", "stage_verdicts", "torch_name", "worst"]


def worst(errors: dict[str, float]) -> tuple[str, float] | None:
    """``(name, error)`` of the largest error, or None for no errors."""
    if not errors:
        return None
    name = max(errors, key=lambda k: errors[k])
    return name, errors[name]


def torch_name(pair: Any, flax_key: str) -> str:
    """``"flax/path (torch name)"`` when the mapping knows the torch parameter."""
    mapping = pair_mapping(pair)
    if mapping is None:
        return flax_key
    for entry in getattr(mapping, "entries", ()):
        path = tuple(entry.flax_path)
        if path and path[0] in ("params", "batch_stats"):
            path = path[1:]
        if "/".join(path) == flax_key:
            return f"{entry.torch_name} (flax {flax_key})"
    return flax_key


def stage_verdicts(
    pair,
    config,
    stage: str,
    dtype: str,
    t: Side,
    j: Side,
    shapes: dict[str, tuple[int, int]],
    widen: str = "",
) -> tuple[list[Verdict], tuple[str, float] | None, tuple[str, float] | None]:
    """One stage's rows (eval-mode output, train-mode output, gradients), the worst output and
    the worst parameter; `shapes` is `parity.verdicts.tolerance.program_shapes`'s. `widen`: why
    each band allows one more rounding in `dtype` per layer (a golden file recorded on other
    kernels: ``SAFETY x depth x u(dtype)``, times the low-precision gradient factor for
    gradients), judged before the rows are frozen; empty: none."""
    base = {**cell_fields(config), "mode": "step 0"}
    compared = "jax vs torch, step 0"
    rows: list[Verdict] = []
    fwd_fan, fwd_depth = shapes["forward"]
    grad_fan, grad_depth = shapes["grad"]
    out_tol = tolerance(dtype, fwd_fan, fwd_depth)
    grad_tol = gradient_tolerance(dtype, grad_fan, grad_depth)
    out_extra = grad_extra = 0.0
    if widen:  # one more rounding in `dtype` per layer
        out_extra = SAFETY * fwd_depth * unit_roundoff(dtype)
        grad_extra = SAFETY * grad_depth * unit_roundoff(dtype) * LOW_PRECISION_GRADIENT_FACTOR
    formula = f"band = {SAFETY:g} x depth x (sqrt(fan-in) x u(float32) + u({dtype}))"

    outputs = {
        "eval logits": relative_error(j.eval_logits, t.eval_logits),
        "train logits": relative_error(j.train_logits, t.train_logits),
        "loss": relative_error(j.loss, t.loss),
    }
    stat_errors, stat_missing = group_errors(j.stats, t.stats)
    outputs.update({f"running stats {k}": v for k, v in stat_errors.items()})
    if stat_missing:
        outputs.update({f"running stats {k} (only on one side)": math.inf for k in stat_missing})
    worst_output = worst(outputs)
    for check, keys in (
        ("eval-mode output", ["eval logits"]),
        ("train-mode output", [k for k in outputs if k != "eval logits"]),
    ):
        errs = {k: outputs[k] for k in keys}
        name, value = worst(errs)
        rows.append(
            verdict(
                check=f"step 0 {stage}: {check}",
                kind="step 0 output",
                compared=compared,
                value=value,
                tolerance=out_tol + out_extra,
                passed=bool(value <= out_tol + out_extra),
                detail=f"worst: {name} (||jax - torch|| / ||torch||); fan-in {fwd_fan}, depth "
                f"{fwd_depth}; {formula}" + (f"; + {out_extra:.3g} for {widen}" if widen else ""),
                **base,
            )
        )
    grad_errors, grad_missing = group_errors(j.grads, t.grads)
    for k in grad_missing:
        grad_errors[k] = math.inf
    worst_param = worst(grad_errors)
    if worst_param is not None:
        name, value = worst_param
        rows.append(
            verdict(
                check=f"step 0 {stage}: gradients",
                kind="step 0 gradients",
                compared=compared,
                value=value,
                tolerance=grad_tol + grad_extra,
                passed=bool(value <= grad_tol + grad_extra),
                detail=f"worst parameter: {torch_name(pair, name)} of {len(grad_errors)}"
                + (f"; missing on one side: {grad_missing}" if grad_missing else "")
                + f"; fan-in {grad_fan}, depth {grad_depth}; {formula}"
                + (
                    f", x {LOW_PRECISION_GRADIENT_FACTOR:g} for gradients below float32"
                    if grad_tol != tolerance(dtype, grad_fan, grad_depth)
                    else ""
                )
                + (f"; + {grad_extra:.3g} for {widen}" if widen else ""),
                **base,
            )
        )
        worst_param = (torch_name(pair, name), value)
    return rows, worst_output, worst_param


def compute_verdicts(config, t: Side, j: Side) -> list[Verdict]:
    """``compute dtype (torch)`` / ``(jax)``: the share of each side's matmul FLOPs in the
    run's compute dtype."""
    want = config.compute_dtype
    base = {**cell_fields(config), "mode": "step 0"}
    rows = []
    for framework, flops in (("torch", t.flops), ("jax", j.flops)):
        fraction = requested_fraction(flops or {}, want)
        total = sum((flops or {}).values())
        by_dtype = ", ".join(
            f"{d} {n / max(total, 1):.0%}" for d, n in sorted((flops or {}).items())
        )
        if fraction is None:
            rows.append(
                verdict(
                    check=f"compute dtype ({framework})",
                    kind="compute dtype",
                    compared=f"{framework} step 0 matmul/conv FLOPs",
                    value="no matmul/conv FLOPs",
                    tolerance=f">= {MIN_COMPUTE_FRACTION:.0%} in {want}",
                    passed=None,
                    detail="nothing to judge",
                    **base,
                )
            )
            continue
        passed = fraction >= MIN_COMPUTE_FRACTION
        detail = f"{total / 1e6:.3g} MFLOP forward+backward: {by_dtype}"
        if not passed:
            detail += f"; the run asked for {want} but its matmuls ran mostly in other dtypes"
        rows.append(
            verdict(
                check=f"compute dtype ({framework})",
                kind="compute dtype",
                compared=f"{framework} step 0 matmul/conv FLOPs in {want}",
                value=fraction,
                tolerance=MIN_COMPUTE_FRACTION,
                passed=passed,
                detail=detail,
                **base,
            )
        )
    return rows
