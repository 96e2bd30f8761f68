"""Train-state glue: a linen `TrainState` and an NNX `Optimizer` with a policy and a loss scale.

Both wrap the optimizer in `jaxamp.loss_scaled`, take gradients of the *scaled* loss and expose
`amp_info`. The skip decision is `loss_scaled`'s, made once (see its docs per loss-scale type,
`NoOpLossScale` included): a non-finite step is skipped completely — params (subnormals
included: `jaxamp.apply_gradients` for linen, `jaxamp.apply_updates` for NNX, whose
`update` returns the updates), optimizer state, `step` and telemetry — or applied
completely; linen and NNX share the code. Params must be in the policy's param dtype (or a
per-module rule's): float16 master weights under "fp16-mixed" are refused, as torch refuses
to unscale float16 gradients.

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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from flax.training import train_state as flax_train_state

from jaxamp.grad import value_and_grad as _value_and_grad
from jaxamp.loss_scale import DynamicLossScale, NoOpLossScale
from jaxamp.optim import (
    AmpInfo,
    LossScaledTransformation,
    amp_info,
    apply_gradients,
    apply_updates,
    get_loss_scale,
    loss_scaled,
)
from jaxamp.policy import Policy, get_policy

__all__ = ["TrainState", "Optimizer", "default_loss_scale", "wrap_optimizer"]


def default_loss_scale(policy: Policy) -> Any:
    """The loss scale ``loss_scale="auto"`` picks: torch's dynamic scale where float16 takes
    part in the policy, no scaling otherwise (bfloat16 has float32's range).

    Example:
      >>> type(jf.default_loss_scale(jaxamp.get_policy("fp16-mixed"))).__name__
      'DynamicLossScale'
      >>> type(jf.default_loss_scale(jaxamp.get_policy("bf16-mixed"))).__name__
      'NoOpLossScale'
    """
    return DynamicLossScale.create() if policy.needs_loss_scaling else NoOpLossScale()


def wrap_optimizer(
    tx: optax.GradientTransformation,
    policy: Policy,
    loss_scale: Any = "auto",
    *,
    max_consecutive_skips: int | None = None,
    on_max_skips: str = "warn",
) -> optax.GradientTransformation:
    """`loss_scaled(tx, ...)`, or `tx` itself if it already is loss-scaled.

    Args:
      tx: an optax optimizer, plain or already wrapped with `jaxamp.loss_scaled`.
      policy: the policy; ``loss_scale="auto"`` reads it.
      loss_scale: "auto" (see `default_loss_scale`), None (torch's defaults), a preset name or
        a loss scale object. Must be "auto" when `tx` is already loss-scaled.
      max_consecutive_skips, on_max_skips: passed to `loss_scaled` (FAULTS 21: report a model
        that overflows at every scale instead of halving forever).

    Raises:
      ValueError: `tx` is already loss-scaled and a `loss_scale` is given too.
    """
    if isinstance(tx, LossScaledTransformation):
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


def _leaf_name(path: tuple) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def check_param_dtypes(params: Any, expected: Callable[[str], Any], policy: Policy, caller: str):
    """Raises `TypeError` naming every floating param leaf whose dtype is not `expected(path)`.

    torch refuses to unscale float16 gradients (float16 master weights lose small updates and
    overflow); a policy that says float32 params while the params are float16 would silently
    train in float16.
    """
    wrong = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            continue
        name = _leaf_name(path)
        allowed = expected(name)
        if np.dtype(dtype) not in allowed:
            wrong.append(
                f"{name} ({np.dtype(dtype).name}; expected "
                f"{' or '.join(sorted(d.name for d in allowed))})"
            )
    if wrong:
        shown = ", ".join(wrong[:8]) + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        raise TypeError(
            f"{caller}: {len(wrong)} parameter leaves are not in the policy's param dtype "
            f"(policy {str(policy)!r}): {shown}. Training them as they are would ignore the "
            "policy (torch likewise refuses to unscale float16 gradients). Fix: create the "
            "params under the policy (jf.linen.with_policy(model.init, policy) / "
            "jf.nnx.apply_policy(model, policy)) or cast them: policy.cast_to_param(params)."
        )


def _rule_param_dtypes(rules: Any) -> set:
    """The param dtypes named by normalised per-module rules."""
    dtypes = set()
    for rule in rules:
        value = rule.value
        dtype = value.param_dtype if isinstance(value, Policy) else value.param
        if dtype is not None:
            dtypes.add(np.dtype(dtype))
    return dtypes


def _advance(step: jax.Array, applied: jax.Array, count_skipped_steps: bool) -> jax.Array:
    one = jnp.ones((), step.dtype)
    return step + (one if count_skipped_steps else applied.astype(step.dtype))


class TrainState(flax_train_state.TrainState):
    """A linen `flax.training.train_state.TrainState` with a policy and a loss scale.

    `apply_fn` runs the model under per-module policies (`jaxamp.flax.linen.with_policy`);
    `opt_state` is the state of `loss_scaled(tx)`, so the loss scale, skip counters and the inner
    optimizer's state travel (and checkpoint) together. `step` is an int32 array.

    Attributes:
      policy: the global policy (static).
      count_skipped_steps: whether `step` advances on skipped steps (static; default False).

    Example:
      >>> model, x, y = nn.Dense(3), jnp.ones((2, 4)), jnp.array([0, 2])
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> state = jf.TrainState.create(
      ...     apply_fn=model.apply, params=params, tx=optax.adam(1e-3), policy="fp16-mixed"
      ... )
      >>> def loss_fn(params, x, y):
      ...     logits = state.apply_fn({"params": params}, x)
      ...     return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      >>> loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)  # scaled grads
      >>> state = state.apply_gradients(grads=grads)  # skips if non-finite
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
          tx: an optax optimizer; wrapped with `jaxamp.loss_scaled` unless it already is.
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
        if not isinstance(count_skipped_steps, bool):
            raise TypeError(
                f"count_skipped_steps must be a bool; got {type(count_skipped_steps).__name__} "
                f"{count_skipped_steps!r}."
            )
        if getattr(apply_fn, "interceptor", None) is None:
            from jaxamp.flax.linen import with_policy

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
        allowed = {np.dtype(policy.param_dtype)} | _rule_param_dtypes(
            getattr(config, "user_rules", ())
        )
        check_param_dtypes(params, lambda _: allowed, policy, "TrainState.create(params=...)")
        tx = wrap_optimizer(
            tx,
            policy,
            loss_scale,
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
            step=_advance(jnp.asarray(self.step), applied, self.count_skipped_steps),
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


class Optimizer(nnx.Optimizer):
    """An `nnx.Optimizer` with a loss scale: skips non-finite steps, exposes `amp_info`.

    Takes the same arguments as `nnx.Optimizer` (``wrt`` is required, as there) plus a policy
    and loss-scale options. `update(model, grads)` takes gradients of the *scaled* loss (from
    `jaxamp.flax.nnx_value_and_grad` or your own scaled `nnx.grad`).

    `step` (uint32, as `nnx.Optimizer`) counts applied updates by default; see the module docs.

    Example:
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
        if not isinstance(count_skipped_steps, bool):
            raise TypeError(
                f"count_skipped_steps must be a bool; got {type(count_skipped_steps).__name__} "
                f"{count_skipped_steps!r}."
            )
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
        self.step[...] = _advance(self.step[...], applied, self.count_skipped_steps)
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

    Example:
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> grad_fn = jf.nnx_value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))
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
        scale_value = jnp.asarray(scale.loss_scale, jnp.float32)

        def scaled(*inner_args):
            out = fn(*inner_args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            loss32 = jnp.asarray(loss).astype(jnp.float32)
            return loss32 * scale_value, (loss32, aux)

        if reduce_dtype is not None:
            (loss, aux), grads = _nnx_reduced(scaled, args, argnums, wrt, reduce_dtype)
            return ((loss, aux), grads) if has_aux else (loss, grads)
        grad_fn = nnx.value_and_grad(scaled, argnums=nnx.DiffState(argnums, wrt), has_aux=True)
        (_, (loss, aux)), grads = grad_fn(*args)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped


def _nnx_reduced(scaled: Callable, args: tuple, argnums: int, wrt: Any, reduce_dtype: Any):
    """`nnx.value_and_grad(scaled)` through split/merge, with `jaxamp._reduce.reduce_in`."""
    from jaxamp._reduce import reduce_in
    from jaxamp.policy import parse_dtype

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
    from jaxamp.flax import _rules
    from jaxamp.flax.nnx import module_policies

    per_module = module_policies(model)

    def expected(name: str) -> set:
        parts = name.split("/")
        for cut in range(len(parts) - 1, -1, -1):
            module_policy = per_module.get(_rules.path_string(parts[:cut]))
            if module_policy is not None:
                return {np.dtype(module_policy.param_dtype)}
        return {np.dtype(policy.param_dtype)}

    params = nnx.as_pure(nnx.state(model, wrt, graph=graph))
    check_param_dtypes(params, expected, policy, "jf.Optimizer(model=...)")
