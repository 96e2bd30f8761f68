"""Calibration runs: how fast does the model amplify rounding, and how much do seeds spread?

- `noise_runs`: the same framework trained again from weights nudged by one ulp (every floating
  parameter moved to the next representable float32 towards +inf). The gap between such a run
  and the unperturbed one is the model's own noise floor; `parity.verdicts.judge` judges the
  cross-framework gap against it (noise-calibrated mode). Records get ``variant="noise"`` and a
  ``perturbation`` text.
- `seed_runs`: K data seeds per framework, same initial weights (``RunConfig.data_seed``), for the
  seed statistics (`parity.verdicts.builders.seed_equivalence`: an equivalence test of final loss and eval metric).

Neither changes the trainers: a perturbed torch model is a copy, perturbed Flax variables are
passed as the trainer's initial variables, and seed runs pass their own batch stream.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch

from parity.training.trainers import train_framework

__all__ = [
    "PERTURBATION",
    "nudge_flax_variables",
    "nudge_torch_module",
    "noise_runs",
    "seed_runs",
]

PERTURBATION = "every floating parameter moved by one ulp towards +inf (nextafter)"
NOISE_FRAMEWORKS = ("none", "torch", "jax", "both")


def nudge_torch_module(module: Any) -> Any:
    """A deep copy of `module` with every floating parameter moved by one ulp towards +inf.

    Example:
      >>> import torch
      >>> m = torch.nn.Linear(2, 1)
      >>> bool((nudge_torch_module(m).weight > m.weight).all())
      True
    """
    nudged = copy.deepcopy(module)
    with torch.no_grad():
        for param in nudged.parameters():
            if param.is_floating_point():
                param.copy_(torch.nextafter(param, torch.full_like(param, float("inf"))))
    return nudged


def nudge_flax_variables(variables: dict) -> dict:
    """`variables` with every floating leaf of ``"params"`` moved by one ulp towards +inf.

    Example:
      >>> import numpy as np
      >>> v = nudge_flax_variables({"params": {"w": np.ones(2, np.float32)}})
      >>> bool((v["params"]["w"] > 1).all())
      True
    """

    def nudge(x):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
            return np.nextafter(x, np.array(np.inf, x.dtype))
        return x

    out = dict(variables)
    out["params"] = jax.tree_util.tree_map(nudge, variables["params"])
    return out


def noise_runs(
    config: Any,
    pair: Any,
    frameworks: Sequence[str] = ("torch",),
    *,
    stream: Any = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Self-divergence calibration runs: each framework trained from 1-ulp-nudged weights.

    Args:
      config: the cell's `RunConfig` (the same as the main runs').
      pair: the model pair.
      frameworks: ``"torch"`` (the reference; the default) and/or ``"jax"``.
      stream: the batch stream (default: the pair's for ``config.stream_seed``).
      progress: tqdm bars.

    Returns:
      Run records with ``variant="noise"`` and ``perturbation`` set.

    Example:
      >>> # runs = noise_runs(config, get_model_pair("resnet"), ("torch", "jax"))
    """
    runs = []
    for framework in frameworks:
        if framework not in ("torch", "jax"):
            raise ValueError(f"noise_runs: frameworks must be 'torch' or 'jax'; got {framework!r}.")
        if stream is None:
            stream = pair.make_data(config.stream_seed, config.batch_size)
        if framework == "torch":
            nudged = dataclasses.replace(pair, torch_model=nudge_torch_module(pair.torch_model))
            run = train_framework("torch", config, nudged, stream, progress=progress)
        else:
            variables = nudge_flax_variables(pair.torch_to_flax())
            run = train_framework(
                "jax", config, pair, stream, progress=progress, variables=variables
            )
        run["variant"] = "noise"
        run["perturbation"] = PERTURBATION
        runs.append(run)
    return runs


def seed_runs(
    config: Any,
    pair: Any,
    seeds: int,
    frameworks: Sequence[str] = ("torch", "jax"),
    *,
    progress: bool = False,
    first: int = 1,
) -> list[dict[str, Any]]:
    """The extra data seeds of seed statistics: ``seeds - 1`` runs per framework.

    The main run uses ``config.stream_seed``; these use the next ``seeds - 1`` data seeds, with
    the same initial weights (the pair is not rebuilt).

    Args:
      config: the cell's `RunConfig`.
      pair: the model pair (its initial weights are shared by every seed).
      seeds: K, the total number of data seeds per framework (>= 2 for statistics).
      frameworks: which frameworks to run.
      progress: tqdm bars.
      first: the first extra seed to train (``first - 1`` are done already: escalation adds
        one order at a time, `parity.compare_models(budget=...)`).

    Returns:
      Run records, one per (extra seed, framework).

    Example:
      >>> # runs = seed_runs(config, pair, seeds=3)   # 2 more data orders per framework
    """
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seed_runs: `seeds` must be an integer >= 1; got {seeds!r}.")
    if isinstance(first, bool) or not isinstance(first, int) or first < 1:
        raise ValueError(f"seed_runs: `first` must be an integer >= 1; got {first!r}.")
    runs = []
    for k in range(first, seeds):
        seed_config = config.replace(data_seed=config.stream_seed + k)
        stream = pair.make_data(seed_config.stream_seed, config.batch_size)
        for framework in frameworks:
            runs.append(train_framework(framework, seed_config, pair, stream, progress=progress))
    return runs
