"""What the linen `TrainState` and the NNX `Optimizer` share: the optimizer wrapped in
`jaxamp.loss_scaled` and the step counter.

Both take gradients of the *scaled* loss and expose `amp_info`. The skip decision is
`loss_scaled`'s, made once (see its docs per loss-scale type, `NoOpLossScale` included): a
non-finite step is skipped completely — params (subnormals included: `jaxamp.apply_gradients`
for linen, `jaxamp.apply_updates` for NNX, whose `update` returns the updates), optimizer
state, `step` and telemetry — or applied completely. Params must be in the policy's param
dtype (or a per-module rule's): float16 master weights under "fp16-mixed" are refused, as torch
refuses to unscale float16 gradients.

The step counter on skipped steps:

* optax schedules *inside* the optimizer read the inner optimizer's own count, which
  `loss_scaled` freezes on skipped steps: they never advance on a skipped step.
* ``TrainState.step`` / ``Optimizer.step`` is the other counter. By default it counts *applied*
  updates only (``count_skipped_steps=False``), so a schedule computed from it (e.g. a learning
  rate passed as ``schedule(state.step)``) does not advance on a skipped step either — torch's
  behaviour, where ``scheduler.step()`` after a skipped ``optimizer.step()`` is the user's
  mistake. With ``count_skipped_steps=True`` it counts every call (batches seen).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._loss_scale import default_loss_scale
from jaxamp._loss_scaled_state import find_states_with_keys
from jaxamp._optim import LossScaledTransformation, loss_scaled
from jaxamp._policy import Policy

__all__ = [
    "PARAM_DTYPE_FIX",
    "advance_step",
    "check_count_skipped_steps",
    "rule_param_dtypes",
    "wrap_optimizer",
]

# What `jaxamp._policy.check_param_dtypes` tells a Flax user whose params miss the policy.
PARAM_DTYPE_FIX = (
    "Fix: create the params under the policy (jf.linen.with_policy(model.init, policy) / "
    "jf.nnx.apply_policy(model, policy)) or cast them: policy.cast_to_param(params)."
)


def wrap_optimizer(
    tx: optax.GradientTransformation,
    policy: Policy,
    loss_scale: Any = "auto",
    *,
    params: Any = None,
    max_consecutive_skips: int | None = None,
    on_max_skips: str = "warn",
) -> optax.GradientTransformation:
    """`loss_scaled(tx, ...)`, or `tx` itself if it already is loss-scaled.

    Args:
      tx: an optax optimizer, plain or already wrapped with `jaxamp.loss_scaled`, or built
        around a loss-scaled one (``jaxamp.multi_steps(jaxamp.loss_scaled(...), k)``: its state
        holds the loss-scaled state, found from `params`).
      policy: the policy; ``loss_scale="auto"`` reads it.
      params: the parameters `tx` will be initialised with (shapes only are used), or None.
      loss_scale: "auto" (see `jaxamp.default_loss_scale`), None (torch's defaults), a preset name or
        a loss scale object. Must be "auto" when `tx` is already loss-scaled.
      max_consecutive_skips, on_max_skips: passed to `loss_scaled` (report a model
        that overflows at every scale instead of halving forever).

    Raises:
      ValueError: `tx` is already loss-scaled and a `loss_scale` is given too.
    """
    if isinstance(tx, LossScaledTransformation) or _holds_loss_scaled_state(tx, params):
        if not (isinstance(loss_scale, str) and loss_scale == "auto"):
            raise ValueError(
                f"loss_scale={loss_scale!r} was given but tx is already wrapped in "
                "jaxamp.loss_scaled; pass the loss scale to one of them, not both."
            )
        return tx
    if isinstance(loss_scale, str) and loss_scale == "auto":
        loss_scale = default_loss_scale(policy)
    return loss_scaled(
        tx,
        loss_scale,
        max_consecutive_skips=max_consecutive_skips,
        on_max_skips=on_max_skips,
    )


def _holds_loss_scaled_state(tx: optax.GradientTransformation, params: Any) -> bool:
    # Abstract init: shapes only, nothing allocated or computed.
    return params is not None and bool(find_states_with_keys(jax.eval_shape(tx.init, params)))


def check_count_skipped_steps(count_skipped_steps: Any) -> bool:
    """`count_skipped_steps` as given, refused unless a bool."""
    if not isinstance(count_skipped_steps, bool):
        raise TypeError(
            f"count_skipped_steps must be a bool; got {type(count_skipped_steps).__name__} "
            f"{count_skipped_steps!r}."
        )
    return count_skipped_steps


def rule_param_dtypes(rules: Any) -> set:
    """The param dtypes named by normalised per-module rules."""
    dtypes = set()
    for rule in rules:
        value = rule.value
        dtype = value.param_dtype if isinstance(value, Policy) else value.param
        if dtype is not None:
            dtypes.add(np.dtype(dtype))
    return dtypes


def advance_step(step: jax.Array, applied: jax.Array, count_skipped_steps: bool) -> jax.Array:
    one = jnp.ones((), step.dtype)
    return step + (one if count_skipped_steps else applied.astype(step.dtype))
