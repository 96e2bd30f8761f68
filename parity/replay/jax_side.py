"""The JAX side of the optimizer replay, and the record of one replayed step both sides fill.

The JAX side is the user's optax transformation inside the run's ``jaxamp.loss_scaled``
(`parity.training.user_loop.loop_optimizer`), fed the gradients in the Flax layout times its own
loss scale, through ``jaxamp.apply_gradients`` (jitted or eager), from the pair's weights and a
fresh state. It imports no torch: a golden check replays a recorded torch side against it
(`parity.replay.record`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from parity.training.user_loop import TrainingLoop, loop_optimizer

__all__ = ["COMPILER_OPTIONS", "STATE_FIELDS", "SideStep", "jax_replay", "jax_stepper"]

STATE_FIELDS = ("mu", "nu", "nu_max", "trace")  # the optimizer state both sides may expose
# The replay's programs run a handful of times on small inputs: compiled without XLA's backend
# optimisations (LLVM at O0), which halves their compile time (the built-in transformer's
# optimizer step: 1.8 -> 1.1 CPU s) and keeps IEEE float32 semantics (no fast math either way);
# what it may change, the contraction of a multiply-add, is within the replay's tolerance.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass
class SideStep:
    """One replayed step of one side (arrays in the Flax layout, keyed by leaf path)."""

    params: dict[str, np.ndarray]  # before the step
    update: dict[str, np.ndarray]  # after - before
    state: dict[str, dict[str, np.ndarray]]  # quantity -> path -> array, after the step
    count: int | None  # the optimizer's step count after the step
    lr: dict[str, float] | float | None  # torch: per path; JAX: the injected rate, if any
    skipped: bool
    scale: float  # the loss scale the step's gradients were multiplied by
    # torch only
    grads: dict[str, np.ndarray] | None = None  # unscaled, after clipping
    clip: float | None = None  # global clipping factor (||after|| / ||before||)
    grad_norm: float | None = None  # global norm before clipping
    groups: dict[str, dict] | None = None  # path -> its param group's hyperparameters
    lr_next: dict[str, float] | None = None  # the group's rate after scheduler.step()
    direction: dict[str, np.ndarray] | None = None  # update at lr 1 (only where a group's lr is 0)


def _walk_state(node: Any, found: dict, lrs: list, counts: list) -> None:
    """Collects mu/nu/nu_max/trace trees, the count beside them and injected learning rates."""
    if isinstance(node, optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState):
        if "learning_rate" in node.hyperparams:
            lrs.append(node.hyperparams["learning_rate"])
        _walk_state(node.inner_state, found, lrs, counts)
        return
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        fields = node._fields
        for field in STATE_FIELDS:
            if field in fields:
                for path, leaf in jax.tree_util.tree_flatten_with_path(getattr(node, field))[0]:
                    if hasattr(leaf, "shape"):
                        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                        found.setdefault(field, {})[key] = np.asarray(leaf, np.float32)
        if "count" in fields and any(f in fields for f in STATE_FIELDS):
            counts.append(int(np.asarray(node.count)))
        for field in fields:
            if field not in STATE_FIELDS:
                _walk_state(getattr(node, field), found, lrs, counts)
        return
    if isinstance(node, tuple | list):
        for item in node:
            _walk_state(item, found, lrs, counts)
    elif isinstance(node, dict):
        for item in node.values():
            _walk_state(item, found, lrs, counts)


def _flat(tree: Any) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        out[key] = np.asarray(leaf, np.float32)
    return out


def _unflat(flat: dict[str, np.ndarray], like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    values = []
    for path, leaf in leaves:
        key = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        values.append(jnp.asarray(flat[key], leaf.dtype))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), values)


def jax_stepper(
    pair: Any, loop: TrainingLoop, config: Any, *, jit: bool = True, params: Any = None
):
    """``(initial params, init, step)`` of the JAX side: ``step(unscaled grads, state, params)
    -> (params, state, scale used, applied)`` multiplies the gradients by the state's loss scale
    (as ``jaxamp.value_and_grad`` returns them) and runs ``jaxamp.apply_gradients``; both are
    jitted once when `jit` (eager otherwise: optax op by op). `params`: the initial Flax params
    (default: the pair's torch weights, ``pair.torch_to_flax()``)."""
    if params is None:
        params = pair.torch_to_flax()["params"]
    params = jax.tree_util.tree_map(jnp.asarray, params)
    tx = loop_optimizer(loop, config, params, pair=pair)

    def step(grads, state, params):
        scale = jaxamp.amp_info(state).loss_scale
        grads = jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), grads)
        params, state = jaxamp.apply_gradients(tx, grads, state, params)
        return params, state, scale, jaxamp.amp_info(state).last_step_applied

    if jit:
        return (
            params,
            jax.jit(tx.init, compiler_options=COMPILER_OPTIONS),
            jax.jit(step, compiler_options=COMPILER_OPTIONS),
        )
    return params, tx.init, step


def jax_replay(
    stepper: tuple[Any, Any, Any], gradients: Sequence[dict[str, np.ndarray]]
) -> list[SideStep]:
    """The user's optax transformation (`jax_stepper`) on the gradient sequence (Flax layout,
    unscaled), from the initial params and a fresh state."""
    params, init, run = stepper
    state = init(params)
    steps = []
    for flat in gradients:
        grads = _unflat(flat, params)
        before = _flat(params)
        params, state, scale, applied = run(grads, state, params)
        after = _flat(params)
        found: dict = {}
        lrs: list = []
        counts: list = []
        _walk_state(state, found, lrs, counts)
        steps.append(
            SideStep(
                params=before,
                update={k: after[k] - before[k] for k in before},
                state=found,
                count=counts[0] if counts else None,
                lr=float(np.asarray(lrs[0])) if len(lrs) == 1 else None,
                skipped=not bool(applied),
                scale=float(scale),
            )
        )
    return steps
