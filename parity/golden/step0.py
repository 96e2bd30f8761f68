"""A golden file's step 0: the rows `parity.verdicts.step0.check_step0` computes, with torch's
side read from the file (no torch here).

The same functions judge both: the output and gradient rows (`parity.verdicts.step0_rows`) per
stage, the layer probe (`parity.verdicts.probe_judge.judge_probe` on the recorded probe), the
rows only torch computes (as recorded), the compute-dtype rows, for a low-bit AdamW precision
jaxamp's optimizer step against torchao's recorded one (`parity.verdicts.optim_judge`), and on
a failure the per-layer
diagnosis (`parity.verdicts.layer_table.layer_rows` on torch's recorded layer outputs) with
`parity.verdicts.layer_table.explain_failure` naming the first diverging layer or the cause.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from parity.core.config import RunConfig
from parity.golden.format import Golden
from parity.verdicts.layer_table import (
    Diagnosis,
    explain_failure,
    first_failing,
    layer_rows,
    mask_padding_rows,
)
from parity.verdicts.optim_judge import compare_optimizer_step, optimizer_state_rows
from parity.verdicts.probe_judge import judge_probe, probe_row
from parity.verdicts.rows import Verdict
from parity.verdicts.sides import jax_side
from parity.verdicts.step0_batch import step0_batch
from parity.verdicts.step0_result import Step0Result
from parity.verdicts.step0_rows import compute_verdicts, stage_verdicts

__all__ = ["golden_step0"]


def _probe(golden: Golden, pair: Any, config: RunConfig) -> tuple[Verdict, Any]:
    """The probe's row and the probe (None when either side could not run it)."""
    record = golden.probe()
    if record is None:
        return probe_row(config, None, golden.probe_error), None
    try:
        probe = judge_probe(pair, record)
    except Exception as e:  # a model the probe cannot drive: the other rows stand without it
        return probe_row(config, None, f"{type(e).__name__}: {str(e)[:300]}"), None
    return probe_row(config, probe), probe


def golden_step0(
    golden: Golden,
    pair: Any,
    config: RunConfig,
    variables: dict,
    inputs: Any,
    targets: Any,
    extra: dict[str, float],
) -> Step0Result:
    """Step 0 of a golden's cell: the JAX side computed here, torch's read from the file.

    Args:
      golden: the loaded golden file.
      pair: the JAX half of the pair.
      config: the cell's configuration.
      variables: the recorded initial weights.
      inputs, targets: the recorded step-0 batch.
      extra: ``{dtype: extra roundings per layer}`` (`parity.golden.check.hardware_allowance`).

    Returns:
      A `Step0Result` as `parity.verdicts.step0.check_step0` returns it (its diagnosis names
      the first diverging layer, or the cause, when a row fails).
    """
    # the examples the export compared (its bound at the time: the recorded outputs' count)
    recorded = len(golden.side(golden.stages[0]["stage"]).eval_logits)
    bounded = step0_batch(pair, variables, inputs, targets, examples=recorded)
    inputs, targets, shapes = bounded.inputs, bounded.targets, bounded.shapes
    padded = golden.padding()
    probe_verdict, probe = _probe(golden, pair, config)
    recorded = golden.torch_rows()
    structure = recorded[:1] + [probe_verdict] + recorded[1:]  # check_step0's order
    verdicts: list[Verdict] = []
    worst_output = worst_param = flops = failed_stage = None
    sides = {}
    for stage in golden.stages:
        stage_config = config.replace(precision=stage["precision"])
        low = not stage_config.recipe.baseline
        t = mask_padding_rows(golden.side(stage["stage"]), padded)
        j = jax_side(pair, variables, inputs, targets, stage_config, stage["loss_scale"], low)
        j = mask_padding_rows(j, padded)
        sides[stage["stage"]] = (t, j)
        dtype = stage_config.compute_dtype
        widen = f"the recorded {dtype} kernels (one rounding per layer)" if extra.get(dtype) else ""
        rows, w_out, w_param = stage_verdicts(
            pair, config, stage["stage"], dtype, t, j, shapes, widen=widen
        )
        verdicts += rows
        if stage["stage"] == "fp32":
            verdicts += structure
        if low:
            verdicts += compute_verdicts(stage_config, t, j)
            flops = {"torch": t.flops or {}, "jax": j.flops or {}}
        stage_failed = any(v.passed is False for v in verdicts)
        if worst_output is None or (stage_failed and failed_stage is None):
            worst_output, worst_param = w_out, w_param
        if stage_failed:
            failed_stage = stage_config
            break  # a broken fp32 port makes the low-precision comparison meaningless
    optimizer = golden.optimizer()
    optim_rows = None
    if optimizer is not None and not any(v.passed is False for v in verdicts):
        try:  # the model agrees: its optimizer? jaxamp's step against torchao's recorded one
            rows = compare_optimizer_step(optimizer[0], pair, config)
        except ValueError as e:
            rows = str(e)
        optim_rows = optimizer_state_rows(config, rows)
        verdicts += optim_rows
    passed = not any(v.passed is False for v in verdicts)
    result = Step0Result(verdicts, passed, worst_output, worst_param, flops, probe=probe)
    result.examples = bounded.to_dict() if bounded.bounded else None
    # the float32 diagnosis would not see an optimizer state's blocks (the model's rows passed)
    if not passed and optim_rows is None:
        try:
            result.diagnosis = _diagnosis(
                golden, pair, failed_stage or config, variables, inputs, shapes, sides
            )
            explain_failure(result.diagnosis, verdicts, probe)
        except Exception as e:  # the verdicts stand without the table
            result.diagnosis_error = f"{type(e).__name__}: {str(e)[:300]}"
    return result


def _diagnosis(golden, pair, config, variables, inputs, shapes, sides) -> Diagnosis:
    """`parity.verdicts.diagnose.diagnose_pair`'s table from torch's recorded layer outputs."""
    pairs, unmatched = golden.module_pairs()
    stages = [("fp32", dataclasses.replace(config, precision="fp32"))]
    if not config.recipe.baseline:
        stages.append((config.precision, config))
    rows = []
    for stage, stage_config in stages:
        if stage not in sides:
            continue
        rows += layer_rows(
            pair,
            stage_config,
            stage,
            golden.layer_outputs(stage),
            variables,
            inputs,
            pairs,
            shapes,
            sides[stage],
        )
    first = first_failing([r for r in rows if r["stage"] == "fp32"]) or first_failing(rows)
    if first is None:
        return Diagnosis(rows, None, unmatched=unmatched)
    return Diagnosis(rows, first[0], first[1], first[2], unmatched)
