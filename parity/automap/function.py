"""Deciding a pairing by what the layers compute.

Where execution order leaves a choice (siblings such as q/k/v projections that receive one
input; layers whose order could not be seen), each candidate pairing is loaded into the Flax
model and run on the example inputs beside the torch model. The weights are redrawn at random
first (a copy; BatchNorm's ones and zeros, zero biases and equal initialisations would hide a
swap), so different layers compute visibly different functions. A candidate fits when every
layer from the choice up to the next open choice returns what its torch twin returns, and, for
the last choice, when the model outputs agree.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from parity.automap.execution import Trace, flax_trace
from parity.pairs.adapters import FlaxModel
from parity.pairs.mapping import MappingEntry, WeightMapping

__all__ = ["Choice", "agree", "agreement_tolerance", "decide", "random_flax", "random_torch"]

# Largest choice tried by function (5! = 120 forward passes); a larger one needs names or rules.
MAX_CHOICE = 5


@dataclasses.dataclass
class Choice:
    """A set of torch layers and as many Flax modules that execution order could not pair.

    Attributes:
      units: torch unit indices, in torch execution order.
      nodes: Flax module paths; ``nodes[k]`` is paired with ``units[k]`` until decided.
      reason: why order could not decide (for the error message).
    """

    units: list[int]
    nodes: list[tuple[str, ...]]
    reason: str


def random_torch(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A float32 copy of `model` whose floating tensors are redrawn (same scale, other values;
    variances positive; tied tensors stay tied)."""
    clone = copy.deepcopy(model).float()
    generator = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for name, tensor in clone.state_dict(keep_vars=True).items():
            if id(tensor) in seen or not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            if name.endswith("running_var"):
                tensor.copy_(0.5 + noise.abs())
                continue
            spread = float(tensor.std()) if tensor.numel() > 1 else 0.0
            level = float(tensor.abs().mean())
            if spread > 0:
                tensor.copy_(tensor.mean() + spread * noise)
            else:  # constant (ones, zeros): spread it
                tensor.copy_(tensor + 0.5 * max(level, 1.0) * noise)
    return clone


def random_flax(flat: Mapping[tuple[str, ...], Any], seed: int = 0) -> dict:
    """Concrete random values for a Flax tree given as shapes (an abstract ``init`` will do):
    enough to run the model once and see which layers it calls, with which inputs."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for path, value in flat.items():
        shape = tuple(int(d) for d in np.shape(value))
        dtype = np.dtype(getattr(value, "dtype", np.float32))
        if not np.issubdtype(dtype, np.floating):
            array = np.zeros(shape, dtype)
        elif path[-1] == "var":
            array = rng.uniform(0.5, 2.0, shape)
        elif path[-1] == "scale":
            array = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) >= 2:
            array = rng.standard_normal(shape) / math.sqrt(math.prod(shape[:-1]))
        else:
            array = 0.1 * rng.standard_normal(shape)
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(array, dtype)
    return out


def agreement_tolerance(model: FlaxModel) -> float:
    """Norm-wise relative error under which two activations count as the same function.

    float32 rounding of these short forward passes stays near 1e-6 and a layer holding another
    layer's redrawn weights is off by O(1), so 1e-3 separates them by orders of magnitude; a
    Flax model computing in bfloat16 (8 significant bits, ~4e-3 per op) or float16 gets a band
    above its own rounding.
    """
    dtype = model.dtype
    if dtype is None:
        return 1e-3
    name = jnp.dtype(dtype).name
    return {"bfloat16": 5e-2, "float16": 1e-2}.get(name, 1e-3)


def agree(torch_value: np.ndarray | None, flax_value: np.ndarray | None, tolerance: float) -> bool:
    """Whether two activations hold the same numbers in any layout (NCHW against NHWC, a CHW
    flatten against an HWC one): their sorted values agree to `tolerance` (norm-wise).
    Unknown values (inside a scan) agree with anything."""
    if torch_value is None or flax_value is None:
        return True
    if torch_value.size != flax_value.size:
        return False
    a, b = np.sort(torch_value.ravel()), np.sort(flax_value.ravel())
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return False
    scale = max(float(np.linalg.norm(a)), 1e-30)
    return float(np.linalg.norm(a - b)) <= tolerance * scale


def decide(
    choices: Sequence[Choice],
    assignment: dict[int, tuple[str, ...]],
    entries_for: Callable[[int, tuple[str, ...]], list[MappingEntry]],
    fixed: list[MappingEntry],
    unit_names: Sequence[str],
    torch_trace: Trace,
    model: FlaxModel,
    flax_inputs: Any,
    torch_weights: torch.nn.Module,
) -> list[tuple[Choice, list[list[tuple[str, ...]]]]]:
    """Decides each choice by function, in torch execution order; `assignment` (unit index ->
    Flax path, every open unit included) is updated in place with each decided pairing.

    Returns:
      The choices that no pairing or several pairings fit, each with the pairings that fit.
    """
    tolerance = agreement_tolerance(model)
    position = {
        index: torch_trace.position(unit_names[index])
        for index in assignment
        if torch_trace.position(unit_names[index]) is not None
    }
    never = math.inf

    def start(choice: Choice) -> float:
        return min((position.get(u, never) for u in choice.units), default=never)

    ordered = sorted(choices, key=start)
    failed = []
    for k, choice in enumerate(ordered):
        begin = start(choice)
        end = start(ordered[k + 1]) if k + 1 < len(ordered) else never
        following = ordered[k + 1].units if k + 1 < len(ordered) else []
        fitting = []
        for order in itertools.permutations(choice.nodes):
            trial = dict(assignment)
            trial.update(zip(choice.units, order, strict=True))
            entries = list(fixed)
            for index, path in trial.items():
                entries += entries_for(index, path)
            variables = WeightMapping(tuple(entries)).to_flax(torch_weights)
            trace = flax_trace(model, variables, flax_inputs)
            if _region_agrees(trial, position, begin, end, following, unit_names, torch_trace, trace, tolerance, last=k + 1 == len(ordered)):  # fmt: skip
                fitting.append(list(order))
        if len(fitting) == 1:
            assignment.update(zip(choice.units, fitting[0], strict=True))
        else:
            failed.append((choice, fitting))
    return failed


def _region_agrees(
    trial, position, begin, end, following, unit_names, torch_trace, trace, tolerance, last
) -> bool:
    def pair(index):
        return torch_trace.calls.get(unit_names[index]), trace.calls.get(trial[index])

    for index in trial:
        if begin <= position.get(index, math.inf) < end:
            torch_call, flax_call = pair(index)
            if flax_call is None:
                continue
            if not agree(torch_call.inputs, flax_call.inputs, tolerance):
                return False
            if not agree(torch_call.output, flax_call.output, tolerance):
                return False
    for index in following:
        torch_call, flax_call = pair(index)
        if torch_call is not None and flax_call is not None:
            if not agree(torch_call.inputs, flax_call.inputs, tolerance):
                return False
    return not last or agree(torch_trace.output, trace.output, tolerance)
