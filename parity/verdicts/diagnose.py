"""Per-layer diagnosis: where do the torch model and its Flax twin part ways?

On one batch and from the same weights, every layer's output is captured on both sides (torch
forward hooks; `parity.pairs.adapters.intercept_calls` on the Flax side, linen or NNX), in eval and
in train mode, together with
each layer's parameter gradients and the running statistics a train-mode pass leaves behind.
Layers are matched through the pair's weight mapping (``pair.mapping.module_pairs()``: torch
module name <-> Flax module path); without a mapping, a torch module ``blocks.1.conv1`` is matched
with the Flax module ``blocks_1/conv1`` (Flax's naming of list members) where that exists.

Each layer's error (``parity.verdicts.step0.relative_error``: normwise relative difference, floored by the
scale) is judged against the step-0 band (``parity.verdicts.step0.tolerance``) with the layer's depth (its
position among the matched layers in torch's execution order), in float32 at the highest matmul
precision and, for a low-precision run, at the run's precision.

The first diverging layer is the first layer, in execution order, whose forward output (eval or
train) exceeds its band; if every output agrees, the first whose running statistics do; else the
last one, in execution order, whose gradients do (the backward pass runs in reverse, so that is
where gradients start to differ). When step 0 fails, the layer probe (each Flax layer fed
torch's input) refines it (`parity.verdicts.layer_table.explain_failure`): a layer that agrees
on torch's input while its own input does not is named as *the input of* that layer (what runs
before it has no weights: an attention core, an activation, a pool); and the headline names the
first divergence in execution order, the probe's where the table's is a gradient one.

It runs automatically when a step-0 verdict fails (`parity.verdicts.step0.check_step0`); call
`diagnose_pair` yourself (e.g. when a trajectory verdict fails, with the failing step's batch and
weights), or `diagnose_config` for a built-in model.

Example::

    from parity.verdicts.diagnose import diagnose_pair
    from parity import models

    diagnosis = diagnose_pair(get_model_pair("resnet", wrong_port="padding"), "fp32")
    print(diagnosis.first_failing)   # blocks.1.conv1
    print(diagnosis.to_markdown())
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import torch

from parity import models
from parity.core.config import RunConfig
from parity.verdicts.layer_table import (
    KINDS,
    Diagnosis,
    first_failing,
    first_tensor,
    layer_rows,
    shaped_error,
)
from parity.verdicts.sides import (
    as_config,
    flatten,
    jax_side,
    torch_device,
)
from parity.verdicts.tolerance import program_shapes
from parity.verdicts.torch_side import layer_arrays, torch_setup, torch_side

__all__ = [
    "KINDS",
    "Diagnosis",
    "diagnose_config",
    "diagnose_pair",
    "diagnose_run",
    "first_tensor",
    "module_pairs",
    "shaped_error",
    "torch_layer_outputs",
]


# --- matching layers ----------------------------------------------------------------------------


def _guess_flax_path(torch_name: str) -> tuple[str, ...]:
    """``blocks.1.conv1`` -> ``("blocks_1", "conv1")`` (Flax names list members ``name_i``)."""
    parts: list[str] = []
    for part in torch_name.split("."):
        if re.fullmatch(r"\d+", part) and parts:
            parts[-1] = f"{parts[-1]}_{part}"
        else:
            parts.append(part)
    return tuple(parts)


def module_pairs(pair: Any, variables: dict) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """``([(torch module, Flax module path), ...], unmatched torch modules)``.

    From ``pair.mapping.module_pairs()`` when the pair has a `WeightMapping`; otherwise every
    torch module that owns parameters or buffers directly is matched with the Flax module of the
    guessed path (`_guess_flax_path`) if the Flax variables have it.
    """
    mapping = getattr(pair, "mapping", None)
    if mapping is not None and hasattr(mapping, "module_pairs"):
        return [(t, tuple(f)) for t, f in mapping.module_pairs()], []
    flax_modules = set()
    for key in list(flatten(variables.get("params", {}))) + list(
        flatten(variables.get("batch_stats", {}))
    ):
        parts = tuple(key.split("/"))[:-1]
        for i in range(1, len(parts) + 1):
            flax_modules.add(parts[:i])
    pairs, unmatched = [], []
    for name, module in pair.torch_model.named_modules():
        owns = any(True for _ in module.parameters(recurse=False)) or any(
            b is not None for b in module.buffers(recurse=False)
        )
        if not name or not owns:
            continue
        path = _guess_flax_path(name)
        if path in flax_modules:
            pairs.append((name, path))
        else:
            unmatched.append(name)
    return pairs, unmatched


# --- capturing layer outputs --------------------------------------------------------------------


def _torch_outputs(pair, names, inputs, config: RunConfig, train: bool) -> dict[str, np.ndarray]:
    model, x = torch_setup(pair, inputs, config)
    captured: dict[str, np.ndarray] = {}
    order: list[str] = []

    def hook(name):
        def record(module, args, output):
            out = first_tensor(output)
            if isinstance(out, torch.Tensor) and name not in captured:
                array = out.detach().float().cpu().numpy().copy()
                if pair.torch_channels_first and array.ndim == 4:
                    array = array.transpose(0, 2, 3, 1)
                captured[name] = array
                order.append(name)

        return record

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        with torch.no_grad(), config.recipe.torch_autocast(torch_device(config)):
            pair.torch_forward(model, x, train=train)
    finally:
        for handle in handles:
            handle.remove()
    return {n: captured[n] for n in order}


# --- the diagnosis ------------------------------------------------------------------------------


def torch_layer_outputs(
    pair, names: list[str], inputs, config: RunConfig
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """torch's first output of each of the modules `names`, in eval then train mode
    (``{module: array in Flax's layout}`` in execution order), at `config`'s precision: the
    diagnosis's torch side (`parity.verdicts.layer_table.layer_rows`; a golden file records it)."""
    return (
        _torch_outputs(pair, names, inputs, config, train=False),
        _torch_outputs(pair, names, inputs, config, train=True),
    )


def _stage_rows(
    pair, config: RunConfig, stage: str, inputs, targets, variables, pairs, shapes, sides
):
    names = [t for t, _ in pairs]
    if sides is None:
        scale = config.recipe.step0_loss_scale(config)
        sides = (
            torch_side(pair, inputs, targets, config, scale, trace_flops=False, layers=names),
            jax_side(pair, variables, inputs, targets, config, scale, trace_flops=False),
        )
    captured = sides[0].layers
    if captured is not None:  # torch's step-0 passes kept each layer's output: none runs twice
        torch_outputs = tuple(layer_arrays(pair, c) for c in captured)
    else:
        torch_outputs = torch_layer_outputs(pair, names, inputs, config)
    return layer_rows(pair, config, stage, torch_outputs, variables, inputs, pairs, shapes, sides)


def diagnose_pair(
    pair: Any,
    config: RunConfig | str = "fp32",
    batch: tuple[Any, Any] | None = None,
    *,
    variables: dict | None = None,
    sides: dict[str, tuple[Any, Any]] | None = None,
    shapes: dict[str, tuple[int, int]] | None = None,
) -> Diagnosis:
    """Compares every matched layer of a pair on one batch, in fp32 and at the run's precision.

    Args:
      pair: a `parity.models.ModelPair` (linen, Hugging Face Flax or NNX on the Flax side).
      config: a `RunConfig` or a precision string.
      batch: ``(inputs, targets)`` (default: batch 0 of the pair's data).
      variables: Flax variables holding the torch model's weights (default: converted from it);
        pass the weights of a later step to diagnose a trajectory failure (and load the same
        weights into ``pair.torch_model``).
      sides, shapes: results `parity.verdicts.step0.check_step0` already computed (internal reuse).

    Returns:
      A `Diagnosis` (rows in execution order, fp32 first; the first diverging layer).

    Example:
      >>> diagnose_pair(get_model_pair("resnet", wrong_port="padding")).first_failing
      'blocks.1.conv1'
    """
    config = as_config(pair, config)
    if batch is None:
        batch = pair.make_data(config.seed, config.batch_size).batch(0)
    inputs, targets = (np.asarray(b) for b in batch)
    if variables is None:
        variables = pair.torch_to_flax()
    pairs, unmatched = module_pairs(pair, variables)
    if shapes is None:
        shapes = program_shapes(pair, variables, inputs, targets)
    sides = sides or {}
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        rows = _stage_rows(
            pair,
            dataclasses.replace(config, precision="fp32"),
            "fp32",
            inputs,
            targets,
            variables,
            pairs,
            shapes,
            sides.get("fp32"),
        )
        if not config.recipe.baseline:
            rows += _stage_rows(
                pair,
                config,
                config.precision,
                inputs,
                targets,
                variables,
                pairs,
                shapes,
                sides.get(config.precision),
            )
    finally:
        torch.set_float32_matmul_precision(previous)
    first = first_failing([r for r in rows if r["stage"] == "fp32"]) or first_failing(rows)
    if first is None:
        return Diagnosis(rows, None, unmatched=unmatched)
    return Diagnosis(rows, first[0], first[1], first[2], unmatched)


def diagnose_config(config: RunConfig, pair: Any = None, step: int = 0) -> Diagnosis:
    """`diagnose_pair` for a run's configuration: the built-in pair of ``config.model`` (unless
    `pair` is given), on the batch of `step` of the run's data (``config.data`` at the run's
    data seed), from the initial weights.

    Example:
      >>> diagnose_config(RunConfig(model="resnet", precision="bf16-mixed")).summary()
      'per-layer diagnosis: every layer within its band'
    """
    if pair is None:
        pair = models.get_model_pair(
            config.model, seed=config.seed, data=config.data, **config.model_overrides
        )
    batch = pair.make_data(config.stream_seed, config.batch_size).batch(step)
    return diagnose_pair(pair, config, batch)


def diagnose_run(run: dict[str, Any], pair: Any = None, step: int = 0) -> Diagnosis:
    """`diagnose_config` for a run record (``results.json``): what `parity.verdicts.judge` calls when a
    trajectory verdict fails, to put the per-layer table in the report.

    Args:
      run: a run record (its ``config`` is read back with `RunConfig.from_dict`).
      pair: the model pair (default: the built-in pair the record names).
      step: whose batch to use (the initial weights are compared: the table says whether the
        models already differ before training, and where).

    Example:
      >>> diagnose_run(load_results("runs/x")["runs"][0]).to_markdown()
    """
    return diagnose_config(RunConfig.from_dict(run["config"]), pair=pair, step=step)
