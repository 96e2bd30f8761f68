"""`loss_scaled`: the optax wrapper that unscales, checks, skips and adjusts, as GradScaler does."""

from __future__ import annotations

import warnings
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import optax

from jaxamp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    _unscale_tree,
    all_finite,
)

__all__ = [
    "AmpInfo",
    "LossScaleDivergedError",
    "LossScaledState",
    "amp_info",
    "get_loss_scale",
    "loss_scaled",
    "set_loss_scale",
]

_INT32_MAX = jnp.iinfo(jnp.int32).max


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    Attributes:
      inner_state: the wrapped optimizer's state; bit-for-bit unchanged on a skipped step.
      loss_scale: the current loss scale (a `DynamicLossScale`, `StaticLossScale`,
        `NoOpLossScale` or a jmp loss scale).
      last_step_finite: whether the last step's gradients were finite (and so applied).
      skipped_steps: total skipped steps (int32, saturating).
      consecutive_skips: skipped steps in a row up to now (int32, saturating).
    """

    inner_state: optax.OptState
    loss_scale: Any
    last_step_finite: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array


class AmpInfo(NamedTuple):
    """In-graph telemetry from `amp_info`; every field is a scalar array (log it, no sync needed).

    Attributes:
      loss_scale: the current loss scale (float32).
      last_step_finite: whether the last step's gradients were finite.
      last_step_applied: whether the last step updated the parameters (same as finite: a
        non-finite step is always skipped).
      skipped_steps: total skipped steps.
      consecutive_skips: skipped steps in a row, ending with the last step.
    """

    loss_scale: jax.Array
    last_step_finite: jax.Array
    last_step_applied: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array


class LossScaleDivergedError(RuntimeError):
    """Raised when a run skips `max_consecutive_skips` steps in a row (it overflows forever)."""


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
    """The type `loss_scaled` returns (an optax `GradientTransformationExtraArgs`)."""


OnMaxSkips = Literal["warn", "raise", "ignore"]


def _as_loss_scale(loss_scale: Any) -> Any:
    if loss_scale is None:
        return DynamicLossScale.create()
    if isinstance(loss_scale, str):
        return DynamicLossScale.from_preset(loss_scale)
    if isinstance(loss_scale, LossScale):  # jaxamp's and jmp's loss scales alike
        return loss_scale
    raise TypeError(
        "loss_scaled(loss_scale=...) takes None (torch's defaults), a preset name "
        "('torch', 'jmp', 'flax', 'keras', 'megatron'), a jaxamp loss scale "
        "(DynamicLossScale, StaticLossScale, NoOpLossScale) or a jmp loss scale; got "
        f"{type(loss_scale).__name__} {loss_scale!r}."
    )


def _identity_updates(shapes: Any) -> Any:
    """Updates that leave every parameter bit-for-bit unchanged under `optax.apply_updates`.

    -0.0, not +0.0: `p + 0.0` turns a parameter of -0.0 into +0.0, while `p + (-0.0)` is `p`
    for every p (NaN payloads included).
    """
    return jax.tree_util.tree_map(_negative_zeros, shapes)


def _negative_zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    zeros = jnp.full(shape.shape, -0.0, shape.dtype)
    # Inside shard_map, `lax.cond` needs both branches to vary over the same mesh axes.
    manual = getattr(shape, "manual_axis_type", None)
    varying = tuple(sorted(getattr(manual, "varying", ()) or ()))
    return jax.lax.pcast(zeros, varying, to="varying") if varying else zeros


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaledState)


def _find_states(opt_state: Any) -> list[tuple[str, LossScaledState]]:
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state, is_leaf=_is_state):
        if _is_state(leaf):
            found.append((jax.tree_util.keystr(path), leaf))
    return found


def _report_diverged(consecutive_skips, limit: int, on_max_skips: OnMaxSkips) -> None:
    message = (
        f"jaxamp.loss_scaled: {int(consecutive_skips)} consecutive steps had non-finite "
        f"gradients (max_consecutive_skips={limit}). The model overflows at every loss scale "
        "(e.g. a float16 forward pass that produces inf or NaN before scaling); lowering the "
        "scale further will not help. Check the loss and activations for inf/NaN."
    )
    if on_max_skips == "raise":
        raise LossScaleDivergedError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=1)


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: Any = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    max_consecutive_skips: int | None = None,
    on_max_skips: OnMaxSkips = "warn",
) -> LossScaledTransformation:
    """Wraps an optax optimizer for loss-scaled gradients, as `torch.amp.GradScaler` does.

    `update` takes the gradients of the *scaled* loss (float16, bfloat16 or float32). It checks
    them for inf/NaN (as torch does, before unscaling), unscales them (computed in float32,
    each leaf keeping its dtype) and runs `inner`. On a non-finite step it returns zero updates
    and leaves `inner`'s state bit-for-bit unchanged (Adam's count does not advance, as in
    torch). Then it adjusts the loss scale. The decision is in-graph (`lax.cond`): no host sync.
    With `NoOpLossScale` it is a pass-through, like `GradScaler(enabled=False)`: nothing is
    skipped (`last_step_finite` still reports whether the gradients were finite).

    Composition:
      * `optax.chain(clip, ...)` *inside* `loss_scaled` clips the unscaled gradients, as
        `GradScaler.unscale_` then `clip_grad_norm_` does; non-finite steps are skipped before
        clipping.
      * `loss_scaled(optax.multi_transform(...))` makes one global decision: a non-finite value
        in any group skips every group (torch with one optimizer). `multi_transform` of several
        `loss_scaled` optimizers gives each group its own scale and skip decision; then
        `get_loss_scale` asks which one you mean.
      * `jaxamp.multi_steps(loss_scaled(opt), k)` accumulates scaled gradients over k
        micro-batches with a constant scale; the scale moves once per real step and a non-finite
        micro-batch skips the whole window. Not `optax.MultiSteps`: it clears its accumulator
        with `0 * acc`, so one NaN poisons every later window. Do not put the accumulation
        inside `loss_scaled` (the scale would then move every micro-batch).

    Args:
      inner: the optimizer to run on the unscaled gradients.
      loss_scale: None (torch's `GradScaler` defaults: `DynamicLossScale.create()`), a preset
        name for `DynamicLossScale.from_preset`, or a loss scale object (jaxamp's or jmp's).
      axis_name: inside `shard_map`/`pmap`, the axis name(s) over which replicas must agree:
        every replica then skips if any replica saw a non-finite value.
      max_consecutive_skips: report a run that skips this many steps in a row, or None.
        torch halves forever; a model that overflows in its forward pass never recovers.
      on_max_skips: "warn" (a `RuntimeWarning`), "raise" (`LossScaleDivergedError`, surfaced by
        the runtime at the next sync), or "ignore" (see `amp_info`). The report fires from a
        callback inside the graph only when the limit is reached.

    Returns:
      A `GradientTransformationExtraArgs` whose state is a `LossScaledState`.

    Raises:
      ValueError: `inner` is already loss-scaled (here or, at `init`, anywhere inside it).

    Examples:
      >>> tx = jaxamp.loss_scaled(optax.adamw(1e-3))
      >>> opt_state = tx.init(params)
      >>> loss, grads = jaxamp.value_and_grad(loss_fn, policy=policy)(
      ...     params, batch, loss_scale=opt_state)
      >>> updates, opt_state = tx.update(grads, opt_state, params)
    """
    if isinstance(inner, LossScaledTransformation):
        raise ValueError(
            "loss_scaled(inner=...): inner is already loss-scaled; wrapping it again would "
            "unscale twice. Use one loss_scaled around the whole optimizer."
        )
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"loss_scaled(inner=...) takes an optax GradientTransformation; got "
            f"{type(inner).__name__}."
        )
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips must be None or an int >= 1; got {max_consecutive_skips!r}."
        )
    if on_max_skips not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_max_skips must be 'warn', 'raise' or 'ignore'; got {on_max_skips!r}.")
    initial_loss_scale = _as_loss_scale(loss_scale)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        inner_state = inner.init(params)
        nested = _find_states(inner_state)
        if nested:
            raise ValueError(
                "loss_scaled(inner=...): inner already contains a loss-scaled optimizer at "
                f"{nested[0][0] or 'its top'}; wrapping it again would unscale twice. Use one "
                "loss_scaled around the whole optimizer."
            )
        return LossScaledState(
            inner_state=inner_state,
            loss_scale=initial_loss_scale,
            last_step_finite=jnp.array(True),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
        )

    def update(updates, state, params=None, **extra_args):
        if not isinstance(state, LossScaledState):
            raise TypeError(
                f"loss_scaled.update(state=...) takes the LossScaledState made by init; got "
                f"{type(state).__name__}. Was this state saved without loss scaling?"
            )
        current = state.loss_scale
        # As torch: check the scaled gradients (an overflow is inf before and after unscaling).
        grads_finite = all_finite(updates, axis_name=axis_name)
        if isinstance(current, (NoOpLossScale, jmp.NoOpLossScale)):
            # Disabled scaling is a pass-through, like GradScaler(enabled=False): nothing is
            # unscaled or skipped, so the run equals one without the wrapper, bit for bit.
            new_updates, new_inner_state = inner.update(
                updates, state.inner_state, params, **extra_args
            )
            return new_updates, state._replace(
                inner_state=new_inner_state, last_step_finite=grads_finite
            )
        # Works for jmp's loss scales too, which have no `inverse_scale`.
        inv_scale = jnp.float32(1.0) / jnp.asarray(current.loss_scale, jnp.float32)

        def apply_step(inner_state):
            grads = _unscale_tree(updates, inv_scale)
            return inner.update(grads, inner_state, params, **extra_args)

        out_shapes = jax.eval_shape(apply_step, state.inner_state)

        def skip_step(inner_state):
            return _identity_updates(out_shapes[0]), inner_state

        new_updates, new_inner_state = jax.lax.cond(
            grads_finite, apply_step, skip_step, state.inner_state
        )
        one = jnp.ones((), jnp.int32)
        skipped = jnp.where(grads_finite, 0, one)
        consecutive = jnp.where(
            grads_finite, 0, jnp.minimum(state.consecutive_skips, _INT32_MAX - 1) + 1
        )
        if max_consecutive_skips is not None and on_max_skips != "ignore":
            jax.lax.cond(
                consecutive == max_consecutive_skips,
                lambda c: jax.debug.callback(
                    _report_diverged, c, max_consecutive_skips, on_max_skips
                ),
                lambda c: None,
                consecutive,
            )
        new_state = LossScaledState(
            inner_state=new_inner_state,
            loss_scale=current.adjust(grads_finite),
            last_step_finite=grads_finite,
            skipped_steps=jnp.minimum(state.skipped_steps, _INT32_MAX - 1) + skipped,
            consecutive_skips=consecutive,
        )
        return new_updates, new_state

    return LossScaledTransformation(init, update)


def _is_variable(x: Any) -> bool:
    # flax.nnx keeps optimizer state in Variables; read their values rather than import nnx.
    return hasattr(x, "get_value") and not isinstance(x, jax.Array)


def _unwrap_variable(x: Any) -> Any:
    return x.get_value() if _is_variable(x) else x


def get_loss_scale(opt_state: Any) -> Any:
    """Returns the current loss scale held anywhere inside an optax state.

    Finds the `LossScaledState` of `loss_scaled` inside chains, `multi_transform`, `MultiSteps`,
    `inject_hyperparams` and other nested states. A loss scale object passed in is returned as is.

    Raises:
      ValueError: no loss-scaled state is found, or several are (one per `multi_transform`
        group): then pick one with `jaxamp.amp_states(opt_state)`.
    """
    if isinstance(opt_state, LossScale) and not isinstance(opt_state, LossScaledState):
        return opt_state
    loss_scale = _one_state(opt_state, "get_loss_scale").loss_scale
    return jax.tree_util.tree_map(_unwrap_variable, loss_scale, is_leaf=_is_variable)


def amp_states(opt_state: Any) -> dict[str, LossScaledState]:
    """Every `LossScaledState` inside `opt_state`, keyed by its path (e.g. ``"[0]"``)."""
    return dict(_find_states(opt_state))


def _one_state(opt_state: Any, caller: str) -> LossScaledState:
    found = _find_states(opt_state)
    if not found:
        raise ValueError(
            f"{caller}(opt_state=...): no loss-scaled optimizer state found (of type "
            f"{type(opt_state).__name__}); build the optimizer with jaxamp.loss_scaled(...)."
        )
    if len(found) > 1:
        paths = ", ".join(path or "<top>" for path, _ in found)
        raise ValueError(
            f"{caller}(opt_state=...): found {len(found)} loss-scaled states (at {paths}); "
            "wrap the whole optimizer in one loss_scaled for a single scale, or pick one from "
            "jaxamp.amp_states(opt_state)."
        )
    return found[0][1]


def set_loss_scale(opt_state: Any, loss_scale: Any) -> Any:
    """Returns `opt_state` with its loss scale replaced (e.g. to reset it after a restore)."""
    loss_scale = _as_loss_scale(loss_scale)
    _one_state(opt_state, "set_loss_scale")

    def replace(x):
        return x._replace(loss_scale=loss_scale) if _is_state(x) else x

    return jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_state)


def amp_info(opt_state: Any) -> AmpInfo:
    """In-graph telemetry of the loss-scaled optimizer inside `opt_state`.

    Returns:
      An `AmpInfo` of scalar arrays: the current scale, whether the last step was finite and
      applied, and total and consecutive skipped steps. Cheap under `jit`; log it.
    """
    state = _one_state(opt_state, "amp_info")
    state = jax.tree_util.tree_map(_unwrap_variable, state, is_leaf=_is_variable)
    return AmpInfo(
        loss_scale=jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
        last_step_finite=state.last_step_finite,
        last_step_applied=state.last_step_finite,
        skipped_steps=state.skipped_steps,
        consecutive_skips=state.consecutive_skips,
    )
