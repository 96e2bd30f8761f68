"""The NNX glue: an `nnx.Optimizer` with a policy and a loss scale, and `nnx_value_and_grad`
(see `jaxamp.flax._glue` for what it shares with the linen `TrainState`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jaxamp._grad import scaled_loss
from jaxamp._loss_scale import NoOpLossScale
from jaxamp._loss_scaled_state import AmpInfo, amp_info, get_loss_scale
from jaxamp._optim import apply_updates
from jaxamp._policy import Policy, check_param_dtypes, get_policy, parse_dtype
from jaxamp._reduce import reduce_in
from jaxamp.flax import _rules
from jaxamp.flax._glue import (
    PARAM_DTYPE_FIX,
    advance_step,
    check_count_skipped_steps,
    wrap_optimizer,
)
from jaxamp.flax.nnx import module_policies

__all__ = ["Optimizer", "nnx_value_and_grad"]


class Optimizer(nnx.Optimizer):
    """An `nnx.Optimizer` with a loss scale: skips non-finite steps, exposes `amp_info`.

    Takes the same arguments as `nnx.Optimizer` (``wrt`` is required, as there) plus a policy
    and loss-scale options. `update(model, grads)` takes gradients of the *scaled* loss (from
    `jaxamp.flax.nnx_value_and_grad` or your own scaled `nnx.grad`).

    `step` (uint32, as `nnx.Optimizer`) counts applied updates by default; see the module docs.

    Examples:
      >>> model = jf.nnx.apply_policy(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "fp16-mixed")
      >>> optimizer = jf.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param, policy="fp16-mixed")
      >>> def loss_fn(model, x, y):
      ...     return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
      >>> @nnx.jit
      ... def train_step(model, optimizer, x, y):
      ...     grad_fn = jf.nnx_value_and_grad(loss_fn)
      ...     loss, grads = grad_fn(model, x, y, loss_scale=optimizer)
      ...     optimizer.update(model, grads)
      ...     return loss, optimizer.amp_info()
      >>> loss, info = train_step(model, optimizer, jnp.ones((2, 4)), jnp.array([0, 2]))
      >>> float(info.loss_scale), bool(info.last_step_applied)
      (65536.0, True)
    """

    def __init__(
        self,
        model: Any,
        tx: optax.GradientTransformation,
        *,
        wrt: Any,
        policy: Any = "fp32",
        loss_scale: Any = "auto",
        count_skipped_steps: bool = False,
        max_consecutive_skips: int | None = None,
        on_max_skips: str = "warn",
        graph: bool | None = None,
    ):
        """See the class docs; `wrt` and `graph` are `nnx.Optimizer`'s."""
        policy = get_policy(policy)
        check_count_skipped_steps(count_skipped_steps)
        tx = wrap_optimizer(
            tx,
            policy,
            loss_scale,
            max_consecutive_skips=max_consecutive_skips,
            on_max_skips=on_max_skips,
        )
        _check_nnx_param_dtypes(model, wrt, graph, policy)
        super().__init__(model, tx, wrt=wrt, graph=graph)
        self.policy = policy
        self.count_skipped_steps = count_skipped_steps

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        """Applies gradients of the scaled loss to `model` in place; skips non-finite steps.

        Returns:
          The updates (zeros on a skipped step).
        """
        param_arrays = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
        opt_state_arrays = nnx.as_pure(self.opt_state)
        kwargs_arrays = nnx.as_pure(kwargs)
        updates, new_opt_state = self.tx.update(
            grad_arrays, opt_state_arrays, param_arrays, **kwargs_arrays
        )
        applied = amp_info(new_opt_state).last_step_applied
        nnx.update(model, apply_updates(param_arrays, updates, new_opt_state))
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
        self.step[...] = advance_step(self.step[...], applied, self.count_skipped_steps)
        return updates

    def amp_info(self) -> AmpInfo:
        """In-graph telemetry: loss scale, last step finite/applied, skipped-step counters."""
        return amp_info(nnx.as_pure(self.opt_state))

    @property
    def loss_scale(self) -> Any:
        """The current loss scale object."""
        return get_loss_scale(nnx.as_pure(self.opt_state))


def nnx_value_and_grad(
    fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    argnums: int = 0,
    wrt: Any = nnx.Param,
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """`nnx.value_and_grad` of the loss times the current loss scale (scaled in float32).

    The returned function takes `fn`'s arguments plus a keyword ``loss_scale``: a
    `jaxamp.flax.Optimizer`, an optax state of `loss_scaled`, a loss scale object, or None (no
    scaling). It returns ``(loss, grads)`` (``((loss, aux), grads)`` with `has_aux`): the
    unscaled loss as float32 and the gradients of the scaled loss, for `Optimizer.update`.

    Args:
      fn: ``fn(model, *args) -> loss`` or ``-> (loss, aux)``.
      has_aux: whether `fn` returns ``(loss, aux)``.
      argnums: which positional argument is differentiated (an NNX module or a pytree).
      wrt: the `nnx.grad` filter (default `nnx.Param`).
      reduce_dtype: FSDP2's ``reduce_dtype`` (e.g. ``"float32"`` for a model under a
        bf16-mixed `jf.nnx.apply_policy`): the gradients of the params the model narrows are
        accumulated, and summed across devices, in it (see `jaxamp.value_and_grad`). The
        differentiated module's state updates (batch statistics, RNG counters) are kept; other
        module arguments are passed by value. Default None: JAX's own gradients.

    Examples:
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> grad_fn = nnx.jit(jf.nnx_value_and_grad(lambda m, x: jnp.mean(m(x) ** 2)))
      >>> loss, grads = grad_fn(model, jnp.ones((3, 2)), loss_scale=jaxamp.StaticLossScale(8.0))
      >>> loss.dtype, grads["kernel"][...].dtype
      (dtype('float32'), dtype('float32'))
    """
    if not callable(fn):
        raise TypeError(f"nnx_value_and_grad(fn=...) takes a callable; got {type(fn).__name__}.")

    def wrapped(*args, loss_scale: Any = None, **kwargs):
        if loss_scale is None:
            scale = NoOpLossScale()
        elif isinstance(loss_scale, Optimizer):
            scale = loss_scale.loss_scale
        else:
            scale = get_loss_scale(nnx.as_pure(loss_scale))
        scaled_fn = scaled_loss(fn, scale, has_aux=has_aux, caller="nnx_value_and_grad")

        def scaled(*inner_args):
            return scaled_fn(*inner_args, **kwargs)

        if reduce_dtype is not None:
            (loss, aux), grads = _nnx_reduced(scaled, args, argnums, wrt, reduce_dtype)
            return ((loss, aux), grads) if has_aux else (loss, grads)
        grad_fn = nnx.value_and_grad(scaled, argnums=nnx.DiffState(argnums, wrt), has_aux=True)
        (_, (loss, aux)), grads = grad_fn(*args)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped


def _nnx_reduced(scaled: Callable, args: tuple, argnums: int, wrt: Any, reduce_dtype: Any):
    """`nnx.value_and_grad(scaled)` through split/merge, with `jaxamp._reduce.reduce_in`."""
    dtype = parse_dtype(reduce_dtype, where="nnx_value_and_grad(reduce_dtype=...)")
    index = argnums % len(args)
    module = args[index]
    graphdef, diff_state, rest_state = nnx.split(module, wrt, ...)
    others = args[:index] + args[index + 1 :]

    def pure(diff_state, rest_state, *others):
        merged = nnx.merge(graphdef, diff_state, rest_state)
        inner = list(others)
        inner.insert(index, merged)
        value, (loss, aux) = scaled(*inner)
        return value, (loss, aux, nnx.state(merged))

    grad_fn = jax.value_and_grad(reduce_in(pure, dtype), has_aux=True)
    (_, (loss, aux, new_state)), grads = grad_fn(diff_state, rest_state, *others)
    nnx.update(module, new_state)
    return (loss, aux), grads


def _check_nnx_param_dtypes(model: Any, wrt: Any, graph: Any, policy: Policy) -> None:
    per_module = module_policies(model)

    def expected(name: str) -> set:
        parts = name.split("/")
        for cut in range(len(parts) - 1, -1, -1):
            module_policy = per_module.get(_rules.path_string(parts[:cut]))
            if module_policy is not None:
                return {np.dtype(module_policy.param_dtype)}
        return {np.dtype(policy.param_dtype)}

    params = nnx.as_pure(nnx.state(model, wrt, graph=graph))
    check_param_dtypes(params, expected, policy, "jf.Optimizer(model=...)", fix=PARAM_DTYPE_FIX)
