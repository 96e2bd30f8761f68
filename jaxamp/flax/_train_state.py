"""A linen `TrainState` with a policy and a loss scale (see `jaxamp.flax._glue` for what it
shares with the NNX `Optimizer`: the loss-scaled optimizer, the skip decision, the step counter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state as flax_train_state

from jaxamp._grad import value_and_grad as _value_and_grad
from jaxamp._loss_scaled_state import AmpInfo, amp_info, get_loss_scale
from jaxamp._optim import apply_gradients
from jaxamp._policy import Policy, check_param_dtypes, get_policy
from jaxamp.flax._glue import (
    PARAM_DTYPE_FIX,
    advance_step,
    check_count_skipped_steps,
    rule_param_dtypes,
    wrap_optimizer,
)
from jaxamp.flax.linen import with_policy

__all__ = ["TrainState"]


class TrainState(flax_train_state.TrainState):
    """A linen `flax.training.train_state.TrainState` with a policy and a loss scale.

    `apply_fn` runs the model under per-module policies (`jaxamp.flax.linen.with_policy`);
    `opt_state` is the state of `loss_scaled(tx)`, so the loss scale, skip counters and the inner
    optimizer's state travel (and checkpoint) together. `step` is an int32 array.

    Attributes:
      policy: the global policy (static).
      count_skipped_steps: whether `step` advances on skipped steps (static; default False).

    Examples:
      >>> model, x, y = nn.Dense(3), jnp.ones((2, 4)), jnp.array([0, 2])
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> state = jf.TrainState.create(
      ...     apply_fn=model.apply, params=params, tx=optax.adam(1e-3), policy="fp16-mixed"
      ... )
      >>> @jax.jit
      ... def train_step(state, x, y):
      ...     def loss_fn(params, x, y):
      ...         logits = state.apply_fn({"params": params}, x)
      ...         return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      ...     loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)  # scaled grads
      ...     return state.apply_gradients(grads=grads), loss  # skips if non-finite
      >>> state, loss = train_step(state, x, y)
      >>> float(state.amp_info().loss_scale), int(state.step)
      (65536.0, 1)
    """

    policy: Policy = struct.field(pytree_node=False, default=None)
    count_skipped_steps: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation,
        policy: Any = "fp32",
        rules: Any = None,
        loss_scale: Any = "auto",
        defaults: bool = True,
        float32_softmax: bool = True,
        count_skipped_steps: bool = False,
        max_consecutive_skips: int | None = None,
        on_max_skips: str = "warn",
        **kwargs: Any,
    ) -> TrainState:
        """Creates the state; wraps `apply_fn` with the policy and `tx` with `loss_scaled`.

        Args:
          apply_fn: usually ``model.apply``; wrapped with `jaxamp.flax.linen.with_policy` unless
            it already is (then `rules`, `defaults` and `float32_softmax` must be left alone).
          params: the params (create them under the policy, e.g. with
            ``jf.linen.with_policy(model.init, policy)``, so each is in its param dtype).
          tx: an optax optimizer; wrapped with `jaxamp.loss_scaled` unless it already is, or
            is built around a loss-scaled one: ``jaxamp.multi_steps(jaxamp.loss_scaled(
            optax.chain(clip, adamw)), k)`` accumulates gradients over `k` calls of
            `apply_gradients` (`step` then counts calls, micro-batches included). Clipping goes
            inside the loss-scaled optimizer, where gradients are unscaled.
          policy: the global policy (anything `jaxamp.get_policy` accepts).
          rules, defaults, float32_softmax: per-module rules, see `jaxamp.flax.linen`.
          loss_scale: "auto" (dynamic for float16 policies, none otherwise), None (torch's
            dynamic defaults), a preset name or a loss scale object.
          count_skipped_steps: whether `step` advances on skipped steps (default: no).
          max_consecutive_skips, on_max_skips: see `jaxamp.loss_scaled`.
          **kwargs: further fields of a subclass.

        Returns:
          A `TrainState` with ``step = int32 0``.
        """
        policy = get_policy(policy)
        check_count_skipped_steps(count_skipped_steps)
        if getattr(apply_fn, "interceptor", None) is None:
            apply_fn = with_policy(
                apply_fn, policy, rules, defaults=defaults, float32_softmax=float32_softmax
            )
        elif rules is not None:
            raise ValueError(
                "rules were given but apply_fn is already wrapped with jf.linen.with_policy; "
                "give the rules to one of them."
            )
        elif apply_fn.policy != policy:
            raise ValueError(
                f"policy={str(policy)!r} but apply_fn is wrapped with policy "
                f"{str(apply_fn.policy)!r}; pass the same policy (or the unwrapped model.apply)."
            )
        # Per-module rules may give some modules another param dtype; which module a leaf
        # belongs to is only known when the model runs, so any rule's param dtype is allowed.
        config = getattr(getattr(apply_fn, "interceptor", None), "config", None)
        allowed = {np.dtype(policy.param_dtype)} | rule_param_dtypes(
            getattr(config, "user_rules", ())
        )
        check_param_dtypes(
            params, lambda _: allowed, policy, "TrainState.create(params=...)", fix=PARAM_DTYPE_FIX
        )
        tx = wrap_optimizer(
            tx,
            policy,
            loss_scale,
            params=params,
            max_consecutive_skips=max_consecutive_skips,
            on_max_skips=on_max_skips,
        )
        return cls(
            step=jnp.zeros((), jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=tx.init(params),
            policy=policy,
            count_skipped_steps=count_skipped_steps,
            **kwargs,
        )

    def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
        """Applies gradients of the *scaled* loss; a non-finite step changes nothing but the
        loss scale and the skip counters.

        Args:
          grads: gradients of the scaled loss (as `value_and_grad` returns them).
          **kwargs: other fields to replace (as Flax's `TrainState.apply_gradients`).

        Returns:
          The new state. `step` advances by one on an applied step; on a skipped step only if
          ``count_skipped_steps``.
        """
        new_params, new_opt_state = apply_gradients(self.tx, grads, self.opt_state, self.params)
        applied = amp_info(new_opt_state).last_step_applied
        return self.replace(
            step=advance_step(jnp.asarray(self.step), applied, self.count_skipped_steps),
            params=new_params,
            opt_state=new_opt_state,
            **kwargs,
        )

    def value_and_grad(
        self, loss_fn: Callable[..., Any], *, has_aux: bool = False, argnums: int = 0
    ) -> Callable[..., Any]:
        """`jaxamp.value_and_grad(loss_fn)` scaled by this state's current loss scale.

        No global cast is applied: `apply_fn` casts per module; gradients are reduced across
        devices in the policy's `reduce_dtype` (see `jaxamp.value_and_grad`). Returns a
        function giving ``(loss, grads)`` (``((loss, aux), grads)`` with `has_aux`): the float32
        unscaled loss and the gradients of the scaled loss, for `apply_gradients`.
        """
        policy = self.policy
        # Per-module casts narrow the params inside apply_fn: reduce their gradients in the
        # policy's reduce_dtype (FSDP2's meaning) where it is wider than the compute dtype.
        reduce_dtype = (
            policy.reduce_dtype
            if policy is not None and policy.reduce_dtype.itemsize > policy.compute_dtype.itemsize
            else None
        )
        grad_fn = _value_and_grad(
            loss_fn, has_aux=has_aux, argnums=argnums, reduce_dtype=reduce_dtype
        )

        def wrapped(*args, **kwargs):
            return grad_fn(*args, loss_scale=self.opt_state, **kwargs)

        return wrapped

    def amp_info(self) -> AmpInfo:
        """In-graph telemetry: loss scale, last step finite/applied, skipped-step counters."""
        return amp_info(self.opt_state)

    @property
    def loss_scale(self) -> Any:
        """The current loss scale object."""
        return get_loss_scale(self.opt_state)
