"""Gradient accumulation that survives an overflowing micro-batch."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._numerics import identity_updates, select_tree

__all__ = ["MultiStepsState", "multi_steps"]


class MultiStepsState(NamedTuple):
    """State of `multi_steps`.

    Attributes:
      mini_step: micro-batches accumulated in the current window (int32).
      acc_grads: running mean of this window's gradients (float32 for float leaves).
      inner_state: the wrapped optimizer's state (e.g. a `loss_scaled` state).

    Examples:
      >>> tx = jaxamp.multi_steps(jaxamp.loss_scaled(optax.sgd(0.1)), every_k=4)
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> isinstance(state, jaxamp.MultiStepsState), int(state.mini_step)
      (True, 0)
    """

    mini_step: jax.Array
    acc_grads: Any
    inner_state: optax.OptState


def _acc_dtype(dtype):
    return jnp.float32 if jnp.dtype(dtype).itemsize <= 4 else dtype


def multi_steps(
    inner: optax.GradientTransformation, every_k: int
) -> optax.GradientTransformationExtraArgs:
    """Accumulates gradients over `every_k` micro-batches, then runs `inner` once on their mean.

    Use it around `jaxamp.loss_scaled` for gradient accumulation with loss scaling:
    ``multi_steps(loss_scaled(adamw(...)), k)``. The loss scale is constant inside a window and
    moves once per real step; a non-finite micro-batch makes the window's mean non-finite, so
    `loss_scaled` skips the whole window and backs off.

    Warning:
      `optax.MultiSteps` clears its accumulator by multiplying it by 0, and NaN * 0 is NaN: after
      one overflowing micro-batch every later window is non-finite too, so a loss-scaled run never
      recovers. This wrapper clears with a select. It also runs `inner` only at the end of a
      window (`lax.cond`), where `optax.MultiSteps` computes it on every micro-batch.

    Args:
      inner: the optimizer to step once per window.
      every_k: micro-batches per window, an int >= 1.

    Returns:
      A `GradientTransformationExtraArgs`; updates are zero except on a window's last micro-batch.

    Examples:
      >>> tx = jaxamp.multi_steps(jaxamp.loss_scaled(optax.sgd(0.1)), every_k=2)
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> grads = {"w": jnp.full(2, 65536.0)}  # scaled by the default 2**16
      >>> update = jax.jit(tx.update)
      >>> updates, opt_state = update(grads, opt_state, params)  # accumulated
      >>> updates["w"]  # nothing applied yet
      Array([-0., -0.], dtype=float32)
      >>> updates, opt_state = update(grads, opt_state, params)  # applied: sgd on the mean
      >>> updates["w"]
      Array([-0.1, -0.1], dtype=float32)
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"multi_steps(inner=...) takes an optax GradientTransformation (e.g. "
            f"jaxamp.loss_scaled(optax.adamw(...))); got {type(inner).__name__} {inner!r}."
        )
    if (
        isinstance(every_k, (bool, np.bool_))
        or not isinstance(every_k, (int, np.integer))
        or every_k < 1
    ):
        raise ValueError(f"multi_steps(every_k=...) must be an int >= 1; got {every_k!r}.")
    every_k = int(every_k)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        acc = jax.tree.map(lambda p: jnp.zeros(p.shape, _acc_dtype(p.dtype)), params)
        return MultiStepsState(jnp.zeros((), jnp.int32), acc, inner.init(params))

    def update(updates, state, params=None, **extra_args):
        count = state.mini_step.astype(jnp.float32)
        acc = jax.tree.map(
            lambda g, a: a + (g.astype(a.dtype) - a) / (count + 1.0), updates, state.acc_grads
        )
        emit = state.mini_step == every_k - 1

        def step(inner_state):
            grads = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)
            return inner.update(grads, inner_state, params, **extra_args)

        def wait(inner_state, out_shapes):
            return identity_updates(out_shapes[0]), inner_state

        if isinstance(emit, jax.core.Tracer):
            # Under `jit`: one `lax.cond`, traced once per trace of the caller's step.
            out_shapes = jax.eval_shape(step, state.inner_state)
            new_updates, inner_state = jax.lax.cond(
                emit, step, lambda s: wait(s, out_shapes), state.inner_state
            )
            # A select, not a multiply by 0: a NaN accumulator must not leak into the next
            # window.
            acc = select_tree(emit, jax.tree.map(jnp.zeros_like, acc), acc)
            mini_step = jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32)
        elif bool(emit):
            # Eagerly the decision is concrete: branch in Python, as `loss_scaled` does. A
            # `lax.cond` here would compile afresh on every call (its branches are new
            # closures each time), about a second per micro-step.
            new_updates, inner_state = step(state.inner_state)
            acc = jax.tree.map(jnp.zeros_like, acc)
            mini_step = jnp.zeros((), jnp.int32)
        else:
            new_updates, inner_state = wait(
                state.inner_state, jax.eval_shape(step, state.inner_state)
            )
            mini_step = (state.mini_step + 1).astype(jnp.int32)
        return new_updates, MultiStepsState(mini_step, acc, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
