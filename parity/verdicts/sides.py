"""Step 0's two sides: what torch and JAX compute on one batch from the same weights.

`jax_side` here and `parity.verdicts.torch_side.torch_side` run the model at the run's precision
exactly as the trainers do (the recipe converts the model, casts, wraps the forward pass) and
return a `Side`: eval-mode and train-mode logits, the loss, the gradients in the Flax layout and
the running statistics a train-mode pass leaves behind. `parity.verdicts.step0` judges them;
`parity.verdicts.diagnose` reuses them. This module does not import torch: a golden check
(`parity.golden.check`) computes the JAX side where torch is not installed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parity.core.config import RunConfig
from parity.core.losses import loss_jax
from parity.core.once import once_jit
from parity.perf.flops import jax_matmul_flops
from parity.perf.phases import phase
from parity.training.steps import jax_forward

__all__ = [
    "Side",
    "as_config",
    "flatten",
    "jax_device",
    "jax_side",
    "pair_mapping",
    "torch_device",
]


@dataclasses.dataclass
class Side:
    """One framework's step-0 numbers (`torch_side`, `jax_side`)."""

    eval_logits: np.ndarray
    train_logits: np.ndarray
    loss: float
    grads: dict[str, np.ndarray]  # "/"-joined Flax param path -> gradient (Flax layout)
    stats: dict[str, np.ndarray]  # "/"-joined Flax batch_stats path -> value after train forward
    flops: dict[str, int] | None = None
    # torch's side only, when asked for: the first output of each named module in the eval and
    # the train pass above, ({module: tensor}, {module: tensor}) in execution order (torch
    # tensors as the passes left them: `parity.verdicts.torch_side.layer_arrays` reads them)
    layers: Any = None


def flatten(tree: Any) -> dict[str, np.ndarray]:
    """``{"a/b/c": float32 numpy}`` for a nested dict of arrays."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        out[key] = np.asarray(leaf).astype(np.float32)  # host-side: no device op per leaf
    return out


def pair_mapping(pair: Any) -> Any:
    """The pair's `WeightMapping`, or None when it has none that maps gradients."""
    mapping = getattr(pair, "mapping", None)
    return mapping if mapping is not None and hasattr(mapping, "grads_to_flax") else None


def torch_device(config: RunConfig) -> str:
    """torch's device type for the run (``"cuda"`` for ``device="gpu"``)."""
    return "cuda" if config.device == "gpu" else "cpu"


def jax_device(config: RunConfig) -> Any:
    """The JAX device of the run (``"gpu"``: the first GPU, else the first CPU)."""
    return jax.devices("gpu" if config.device == "gpu" else "cpu")[0]


def jax_side(pair, variables, inputs, targets, config, loss_scale, trace_flops) -> Side:
    """JAX's step-0 numbers at the run's precision, from the same forward pass the trainer runs
    (`parity.training.steps.jax_forward`) and the recipe's casts."""
    recipe = config.recipe
    forward_train = jax_forward(pair, recipe, config.device, train=True)
    forward_eval = jax_forward(pair, recipe, config.device, train=False)

    def train_grads(params, batch_stats, x, y):
        # bf16-true: params, statistics and inputs in low precision (else unchanged)
        params, batch_stats, x = recipe.jax_cast((params, batch_stats, x))

        def loss_fn(params):
            logits, new_stats = forward_train(params, batch_stats, x)
            loss = loss_jax(pair.task, logits.astype(jnp.float32), y)
            return loss * jnp.float32(loss_scale), (loss, logits, new_stats)

        grads, aux = jax.grad(loss_fn, has_aux=True)(params)
        return grads, aux, (params, batch_stats, x)

    # A program of its own inside `run`: its jaxpr is where the FLOPs are counted, from the one
    # trace that also compiles (a second trace of the gradient costs about as much again).
    inner = jax.jit(train_grads)

    def run(params, batch_stats, x, y):
        grads, (loss, logits, new_stats), (params, batch_stats, x) = inner(
            params, batch_stats, x, y
        )
        eval_logits, _ = forward_eval(params, batch_stats, x)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / jnp.float32(loss_scale), grads)
        as32 = functools.partial(jax.tree.map, lambda v: v.astype(jnp.float32))
        return as32(eval_logits), loss, as32(logits), as32(new_stats), grads

    args = (
        variables["params"],
        variables.get("batch_stats"),
        np.asarray(inputs),
        np.asarray(targets),
    )
    with jax.default_matmul_precision("highest"), jax.default_device(jax_device(config)):
        traced = once_jit(run).trace(*args)
        flops = None
        if trace_flops:
            with phase("dtype trace"):
                flops = jax_matmul_flops(_named_jaxpr(traced.jaxpr, "train_grads"))
        with phase("compile"):
            compiled = traced.lower().compile()
        with phase("run"):
            eval_logits, loss, logits, new_stats, grads = jax.device_get(compiled(*args))
    return Side(
        np.asarray(eval_logits),
        np.asarray(logits),
        float(loss),
        flatten(grads),
        flatten(new_stats if new_stats is not None else {}),
        flops,
    )


def _named_jaxpr(closed_jaxpr: Any, name: str) -> Any:
    """The jaxpr of the first inner program called `name` (a nested ``jax.jit``)."""
    for eqn in closed_jaxpr.jaxpr.eqns:
        if eqn.params.get("name") == name and "jaxpr" in eqn.params:
            return eqn.params["jaxpr"]
    raise ValueError(f"no inner program named {name!r} in the traced step-0 program")


def as_config(pair: Any, precision_or_config: Any) -> RunConfig:
    """A `RunConfig` (returned as is) or a precision name (the pair's default run at it)."""
    if isinstance(precision_or_config, RunConfig):
        return precision_or_config
    if isinstance(precision_or_config, str):
        return RunConfig(model=pair.name, precision=precision_or_config)
    raise TypeError(
        "check_step0: `config` must be a RunConfig or a precision string (e.g. 'bf16-mixed'); "
        f"got {type(precision_or_config).__name__}."
    )
