"""Step-0 verdicts: do the two models agree before any training?

On one batch, from the same weights, both frameworks compute

- the eval-mode logits, the train-mode logits and loss, and the running statistics a train-mode
  forward pass leaves behind (BatchNorm);
- the gradient of the loss with respect to every parameter (mapped into the Flax layout by the
  pair's weight mapping, so the k-th number of a torch gradient meets the k-th number of the
  matching Flax gradient);

first in float32 at the highest matmul precision on both sides
(``torch.set_float32_matmul_precision("highest")``, ``jax.default_matmul_precision("highest")``),
then at the run's precision (autocast / bf16-true casting, exactly as the trainers do). At the
run's precision it also measures which dtype the matmul and convolution FLOPs ran in on each side
(the compute-dtype verdict: a bf16 run whose matmuls ran in float32 fails and says so). For the
fp8 precisions (whose policy is fp32 outside the converted linear layers) the run-precision rows
are `parity.core.fp8.step0_fp8`'s instead: every converted layer's scales and fp8 codes of input,
weight and output gradient, torchao against jaxamp.fp8.

Error measures and bands (normwise relative error, group floors, ``band = SAFETY * depth *
(sqrt(fan_in) * u(float32) + u(dtype))`` with fan-in and depth read from the JAX program) are
`parity.verdicts.tolerance`'s, where the reasoning behind them is written down.

Beyond the model's own init, the float32 stage of every precision adds the rows of
`parity.verdicts.step0_checks`: each mapped layer on its whole operating range (`parity.verdicts.layer_probe`:
probe weights, each Flax layer fed torch's input, judged against a band of its own and its noise
floor), torch modules whose train-mode output is random (dropout left on), and, for information,
tensors the weight mapping folds.

A failure names the worst parameter and the worst output, and (``diagnose=True``) the per-layer
diagnosis of `parity.verdicts.diagnose` names the first layer whose error exceeds its band, or the cause
that is not a layer's (stochastic modules, the compute dtype).

Example::

    from parity.models import get_model_pair
    from parity.verdicts.step0 import check_step0

    result = check_step0(get_model_pair("resnet"), "bf16-mixed")
    print(result.passed, result.summary())
    for verdict in result.verdicts:
        print(verdict.check, verdict.value, verdict.tolerance, verdict.passed)
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import torch

from parity.core.config import RunConfig
from parity.core.records import build_error_record
from parity.perf.phases import phase
from parity.verdicts.diagnose import diagnose_pair, module_pairs
from parity.verdicts.optim_step0 import optimizer_state_verdicts
from parity.verdicts.qualifiers import verdict
from parity.verdicts.rows import Verdict, cell_fields
from parity.verdicts.sides import Side, as_config, jax_side
from parity.verdicts.step0_batch import step0_batch
from parity.verdicts.step0_checks import (
    dropout_verdict,
    explain_failure,
    folded_verdict,
    mask_padding_rows,
    padding_rows,
    padding_verdict,
    probe_verdict,
    stochastic_verdict,
)
from parity.verdicts.step0_result import Step0Failure, Step0Result
from parity.verdicts.step0_rows import compute_verdicts, stage_verdicts
from parity.verdicts.torch_side import torch_stage_side

__all__ = [
    "Step0Failure",
    "Step0Result",
    "attach_step0",
    "blocked_records",
    "check_step0",
    "run_step0",
]


_DOWNSTREAM = (
    "after a flipped code: codes within 1 fp8 step of the row's largest, scales within 1 step"
)
_FP8_TOLERANCES = {
    "weight": "quantizer exact; scales and codes equal",
    "input": f"quantizer exact; scales within 8 float32 eps, codes within 1 fp8 step ({_DOWNSTREAM})",
    "grad_output": "quantizer exact; scales within 8 float32 eps, codes within 1 fp8 step of the "
    f"row's largest ({_DOWNSTREAM})",
}


def _quantized_verdicts(pair, config: RunConfig, inputs, targets) -> list[Verdict]:
    """Step-0 rows of a recipe whose step-0 checks name ``"quantized layers"`` (fp8, MX):
    `parity.core.recipes.Recipe.quantized_layers_step0` (torchao's scales and codes against
    jaxamp's, every converted layer), one row per tensor (input, weight, grad_output).

    The generic run-precision rows would compare two float32 models (an fp8 precision's policy
    is fp32 outside the converted layers, and neither side applies fp8 there), so they say
    nothing about the fp8 recipes. A layer converted on one side only fails the run.
    """
    base = cell_fields(config)
    prefix = f"step 0 {config.precision}"
    try:
        rows = config.recipe.quantized_layers_step0(pair, inputs, targets)
    except ValueError as e:  # the two sides convert different layers
        return [
            verdict(
                check=f"{prefix}: fp8 layers",
                kind="quantized layers",
                compared="torchao Float8Linear layers vs jaxamp.fp8 matmuls",
                value="mismatch",
                tolerance="same layers",
                passed=False,
                detail=str(e)[:500],
                mode="step 0",
                **base,
            )
        ]
    verdicts = []
    for tensor, tol in _FP8_TOLERANCES.items():
        group = [r for r in rows if r["tensor"] == tensor]
        if not group:
            continue
        failed = [r for r in group if not r["passed"]]
        steps = max(r["max_code_steps"] for r in group)
        rel = max(r["scale_max_rel_diff"] for r in group)
        differing = sum(r["codes_differing"] for r in group)
        total = sum(r["codes"] for r in group)
        downstream = [r["torch_module"] for r in group if r["downstream_of_flip"]]
        detail = (
            f"{len(group)} layers ({', '.join(r['torch_module'] for r in group)}); "
            f"scales max rel diff {rel:.3g}; {differing}/{total} codes differ, "
            f"by at most {steps} fp8 steps"
            + (f"; after a flipped code: {', '.join(downstream)}" if downstream else "")
        )
        if failed:
            detail = (
                "failing layers: "
                + ", ".join(
                    f"{r['torch_module']} ("
                    + ("" if r["quantizer_exact"] else "quantizer not exact on torch's tensor, ")
                    + f"scale rel diff {r['scale_max_rel_diff']:.3g}, "
                    f"{r['codes_differing']}/{r['codes']} codes differ"
                    + (f", {r['detail']}" if r.get("detail") else "")
                    + ")"
                    for r in failed[:3]
                )
                + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
                + "; "
                + detail
            )
        verdicts.append(
            verdict(
                check=f"{prefix}: fp8 {tensor} scales and codes",
                kind="quantized layers",
                compared="jaxamp.fp8 vs torchao, every converted layer",
                value=f"{len(failed)}/{len(group)} layers off",
                tolerance=tol,
                passed=not failed,
                detail=detail,
                mode="step 0",
                **base,
            )
        )
    return verdicts


def check_step0(
    pair: Any,
    config: RunConfig | str = "fp32",
    batch: tuple[Any, Any] | None = None,
    *,
    variables: dict | None = None,
    diagnose: bool = True,
) -> Step0Result:
    """Step-0 verdicts for a model pair: outputs and gradients, fp32 first, then the run's precision.

    Args:
      pair: a `parity.models.ModelPair` (built-in or user; ``pair.mapping`` is used when present).
      config: a `RunConfig`, or just its precision (``"fp32"``, ``"bf16-mixed"``, ...).
      batch: ``(inputs, targets)`` numpy arrays (default: batch 0 of the pair's data at
        ``config.seed``/``config.batch_size``). Step 0 compares its first examples only, as
        many as a forward pass of ``STEP0_FLOPS`` matmul FLOPs holds, where the whole batch is
        more work than that (`parity.verdicts.step0_batch`; the result's ``examples`` says so).
      variables: the Flax variables to start from (default: converted from the torch model).
      diagnose: on a failure, run `parity.verdicts.diagnose.diagnose_pair` at the failing stage's precision
        and keep its table in the result.

    Returns:
      A `Step0Result`: rows ``step 0 fp32: eval-mode output``, ``... train-mode output`` (logits,
      loss, running statistics), ``... gradients``, then ``step 0: deterministic train-mode
      forward (torch)``, ``step 0 fp32: each layer on its operating range`` (and, when the mapping
      folds tensors, the informational ``step 0: tensors folded by the mapping``; when the two
      models' dropout rates differ, the informational ``step 0: dropout rates differ (turned
      off on both sides)``); the same
      output and gradient rows with ``step 0 <precision>`` for a
      low-precision run, then ``compute dtype (torch)``, ``compute dtype (jax)``. For an fp8
      precision the run-precision rows are ``step 0 <precision>: fp8 {input,weight,grad_output}
      scales and codes`` from `parity.core.fp8.step0_fp8` (torchao against jaxamp.fp8, every
      converted layer; mode ``"step 0"``) instead. For a low-bit AdamW precision (torchao's
      quantized optimizer state), once the model's rows pass: ``step 0 <precision>: optimizer
      state codes and scales`` and ``... weights after one optimizer step``
      (`parity.verdicts.optim_step0`: one torchao and one jaxamp step from torch's gradients,
      codes and scales bit-identical).

    Example:
      >>> result = check_step0(get_model_pair("resnet", wrong_port="padding"))
      >>> result.passed, result.diagnosis.first_failing
      (False, 'blocks.1.conv1')
    """
    config = as_config(pair, config)
    if batch is None:
        batch = pair.make_data(config.seed, config.batch_size).batch(0)
    inputs, targets = (np.asarray(b) for b in batch)
    if variables is None:
        variables = pair.torch_to_flax()
    previous = torch.get_float32_matmul_precision()
    previous_cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False  # convolutions at full float32 too
    try:
        stages = [("fp32", dataclasses.replace(config, precision="fp32"))]
        if not config.recipe.baseline:
            stages.append((config.precision, config))
        verdicts: list[Verdict] = []
        worst_output = worst_param = None
        flops = None
        failed_stage = None
        fp8_failed = False
        with phase("outputs and gradients"):  # the batch's first examples where it is large
            bounded = step0_batch(pair, variables, inputs, targets)
        inputs, targets, shapes = bounded.inputs, bounded.targets, bounded.shapes
        sides: dict[str, tuple[Side, Side]] = {}
        # torch's passes keep each layer's output for the diagnosis (no pass runs twice)
        layers = [name for name, _ in module_pairs(pair, variables)[0]] if diagnose else None
        # Beyond the model's own init, whatever the precision: every layer on its operating
        # range, stochastic torch modules, tensors the mapping folds (parity.verdicts.step0_checks).
        with phase("layer probe"):
            probe_row, probe = probe_verdict(pair, config, inputs, shapes["forward flops"])
        structure = [probe_row]  # the stochastic row goes first, once torch's side has run
        folded = folded_verdict(pair, config)
        if folded is not None:
            structure.append(folded)
        padded = padding_rows(pair)  # rows torch never trains: out of the gradient comparison
        padding = padding_verdict(config, padded)
        if padding is not None:
            structure.append(padding)
        dropout = dropout_verdict(pair, config)  # rates that differ, turned off: not tested
        if dropout is not None:
            structure.append(dropout)
        for stage, stage_config in stages:
            low = not stage_config.recipe.baseline
            fp8_rows = None
            if low and "quantized layers" in stage_config.recipe.step0_checks:
                with phase("fp8 codes"):
                    fp8_rows = _quantized_verdicts(pair, stage_config, inputs, targets)
            if fp8_rows is not None:  # fp32 stage passed: compare the fp8 recipes
                verdicts.extend(fp8_rows)
                if any(v.passed is False for v in verdicts):
                    fp8_failed = True
                break
            with phase("outputs and gradients"):
                with phase("torch"):
                    t, scale = torch_stage_side(
                        pair, inputs, targets, stage_config, trace_flops=low, layers=layers
                    )
                with phase("jax"):
                    j = jax_side(
                        pair, variables, inputs, targets, stage_config, scale, trace_flops=low
                    )
            if stage == "fp32":  # one more train-mode call must give torch's output again
                with phase("stochastic modules"):
                    structure.insert(
                        0, stochastic_verdict(pair, config, inputs, reference=t.train_logits)
                    )
            t, j = mask_padding_rows(t, padded), mask_padding_rows(j, padded)
            sides[stage] = (t, j)
            rows, w_out, w_param = stage_verdicts(
                pair, config, stage, stage_config.compute_dtype, t, j, shapes
            )
            verdicts.extend(rows)
            if stage == "fp32":
                verdicts.extend(structure)
            if low:
                verdicts.extend(compute_verdicts(stage_config, t, j))
                flops = {"torch": t.flops or {}, "jax": j.flops or {}}
            stage_failed = any(v.passed is False for v in verdicts)
            if worst_output is None or (stage_failed and failed_stage is None):
                worst_output, worst_param = w_out, w_param
            if stage_failed and failed_stage is None:
                failed_stage = stage_config
                break  # a broken fp32 port makes the low-precision comparison meaningless
        optim_rows = None
        if "optimizer state" in config.recipe.step0_checks and not any(
            v.passed is False for v in verdicts
        ):  # the model agrees: its optimizer?
            with phase("optimizer state"):
                optim_rows = optimizer_state_verdicts(pair, config, inputs, targets)
            verdicts.extend(optim_rows or [])
        passed = not any(v.passed is False for v in verdicts)
        result = Step0Result(verdicts, passed, worst_output, worst_param, flops, probe=probe)
        result.examples = bounded.to_dict() if bounded.bounded else None
        # an fp8 failure is already per layer; the float32 diagnosis would not apply fp8
        # nor would it see an optimizer state's blocks (the model's own rows passed)
        if not passed and diagnose and not fp8_failed and optim_rows is None:
            with phase("diagnosis"):
                try:
                    result.diagnosis = diagnose_pair(
                        pair,
                        failed_stage or config,
                        (inputs, targets),
                        variables=variables,
                        sides=sides,
                        shapes=shapes,
                    )
                    explain_failure(result.diagnosis, verdicts, probe)
                except Exception as e:  # the verdicts stand without the table
                    result.diagnosis_error = f"{type(e).__name__}: {str(e)[:300]}"
        return result
    finally:
        torch.backends.cudnn.allow_tf32 = previous_cudnn_tf32
        torch.set_float32_matmul_precision(previous)


# --- the run flow -------------------------------------------------------------------------------


def run_step0(
    config: RunConfig,
    pair: Any,
    stream: Any = None,
    *,
    frameworks: tuple[str, ...] = ("torch", "jax"),
    echo: bool = True,
) -> Step0Result | None:
    """The step-0 gate of a training run (`parity.cli.commands.run_pair`, `parity.compare_models`).

    Runs `check_step0` on the run's first batch when both frameworks are trained (one side alone
    has nothing to compare with: returns None), and prints the one-line summary (and, on a
    failure, the per-layer table) to stderr when `echo`.

    Args:
      config: the run's configuration.
      pair: the model pair.
      stream: the run's `BatchStream` (default: the pair's data at the run's data seed).
      frameworks: the frameworks the run trains.
      echo: print the outcome.

    Returns:
      The `Step0Result`, or None when fewer than two frameworks run. When the checks themselves
      raise (say, torch has no kernel for the dtype on this CPU), a passing result with one
      informational row saying why: the trainers then record the cell's real outcome.

    Example:
      >>> result = run_step0(config, pair)
      >>> if result is not None and not result.passed: runs = blocked_records(config, result)
    """
    if set(frameworks) != {"torch", "jax"}:
        return None
    if stream is None:
        seed = getattr(config, "stream_seed", config.seed)
        stream = pair.make_data(seed, config.batch_size)
    try:
        result = check_step0(pair, config, stream.batch(0))
    except Exception as e:  # e.g. no kernel for this dtype here: training reports it, not step 0
        reason = f"{type(e).__name__}: {str(e)[:300]}"
        row = verdict(
            check="step 0",
            compared="jax vs torch, step 0",
            value=f"not run ({reason})",
            tolerance="-",
            passed=None,
            detail="the step-0 checks raised; training goes on and records its own outcome",
            mode="step 0",
            kind="step 0 ran",
            **cell_fields(config),
        )
        result = Step0Result([row], True)
    if echo:
        print(f"{config.model} {config.precision}: {result.summary()}", file=sys.stderr)
        if result.diagnosis is not None:
            print(result.diagnosis.to_markdown(), file=sys.stderr)
    return result


def blocked_records(
    config: RunConfig, result: Step0Result, frameworks: tuple[str, ...] = ("torch", "jax")
) -> list[dict[str, Any]]:
    """Error records for a run stopped before training by a failed step 0 (``compare`` fails
    them with the step-0 summary: the worst output, parameter and first diverging layer), each
    carrying the full step-0 result under ``"step0"``.

    Example:
      >>> runs = blocked_records(config, result)   # instead of training
    """
    return attach_step0(
        [build_error_record(fw, config, Step0Failure(result)) for fw in frameworks], result
    )


def attach_step0(runs: list[dict[str, Any]], result: Step0Result | None) -> list[dict[str, Any]]:
    """Stores ``result.to_dict()`` under ``"step0"`` in every run record (None: unchanged)."""
    if result is not None:
        for run in runs:
            run["step0"] = result.to_dict()
    return runs
