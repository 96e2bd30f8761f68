"""`loss_scaled`: the optax wrapper that unscales, checks, skips and adjusts, as GradScaler does;
`apply_gradients` and `apply_updates`, its steps. Its state and the queries on it (`amp_info`,
`get_loss_scale`, ...) live in `jaxamp._loss_scaled_state`."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

from jaxamp._loss_scale import NoOpLossScale, as_loss_scale
from jaxamp._loss_scaled_state import (
    LossScaledState,
    check_outermost,
    find_states_with_keys,
    loss_scaled_states,
    one_state,
    unwrap_variables,
)
from jaxamp._numerics import (
    AxisName,
    branch_or_select,
    check_axis_name,
    check_replicas_agree,
    count_if,
    finite_after,
    fresh_buffers,
    identity_updates,
    select_leaves,
    select_tree,
    skip_updates,
    unscaler,
)
from jaxamp._policy import Policy, check_param_dtypes, get_policy
from jaxamp._provenance import leaf_paths, measure_overflow, no_overflow

__all__ = [
    "LossScaleDivergedError",
    "LossScaledTransformation",
    "apply_gradients",
    "apply_updates",
    "loss_scaled",
]


class LossScaleDivergedError(RuntimeError):
    """Raised when a run skips `max_consecutive_skips` steps in a row (it overflows forever).

    Examples:
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1), max_consecutive_skips=3, on_max_skips="raise")
      >>> issubclass(jaxamp.LossScaleDivergedError, RuntimeError)
      True
    """


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
    """The optimizer `loss_scaled` returns: an optax `GradientTransformationExtraArgs` (`init`,
    `update`) with one more method, `update_and_apply`.

    Examples:
      >>> tx = jaxamp.loss_scaled(optax.adam(1e-3))
      >>> isinstance(tx, jaxamp.LossScaledTransformation), isinstance(tx, optax.GradientTransformation)
      (True, True)
    """

    def update_and_apply(
        self, grads: Any, opt_state: Any, params: Any, **extra_args: Any
    ) -> tuple[Any, Any]:
        """One step returning ``(new_params, new_opt_state)`` instead of updates.

        The values of `update` then `jaxamp.apply_updates`, with the parameter update inside
        the skip decision: under `jit` on CPU ``params + updates`` fuses into the optimizer's
        update (no updates array written out and read back), and a skipped step returns
        `params` bit for bit. `jaxamp.apply_gradients` calls it.

        Examples:
          >>> tx = jaxamp.loss_scaled(optax.sgd(0.5))
          >>> params = {"w": jnp.ones(2)}
          >>> opt_state = tx.init(params)
          >>> grads = jaxamp.get_loss_scale(opt_state).scale({"w": jnp.ones(2)})
          >>> tx.update_and_apply(grads, opt_state, params)[0]["w"]
          Array([0.5, 0.5], dtype=float32)
        """
        scaler = getattr(self.update, "__self__", None)
        if not isinstance(scaler, _LossScaler):
            raise TypeError(
                "LossScaledTransformation.update_and_apply: this transformation was not built "
                "by jaxamp.loss_scaled(...); build it with loss_scaled rather than by hand."
            )
        return scaler.update_and_apply(grads, opt_state, params, **extra_args)


OnMaxSkips = Literal["warn", "raise", "ignore"]


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


def _report_at_limit(consecutive, limit: int, on_max_skips: OnMaxSkips) -> None:
    """Reports the step whose consecutive skips reach `limit`, on every platform.

    Eagerly (a concrete count) the report is made here, on the calling thread: a
    `RuntimeWarning`, or `LossScaleDivergedError` raised by the call itself. Under a trace it
    is a host callback inside a `lax.cond` on ``consecutive == limit`` (XLA keeps a branch
    with a side effect as a branch on every platform; it never becomes a select): the
    callback runs while that step executes, so the warning has been issued when the step's
    outputs are ready, and with "raise" the step fails and its outputs raise
    `jax.errors.JaxRuntimeError` (carrying the message) where they are read. Only that step
    reports, once; a finite step resets the count and a later run of `limit` skips reports
    again.
    """
    if not isinstance(consecutive, jax.core.Tracer):
        if int(consecutive) == limit:
            _report_diverged(consecutive, limit, on_max_skips)
        return
    _check_host_callbacks(limit, on_max_skips)
    jax.lax.cond(
        consecutive == limit,
        lambda c: jax.debug.callback(_report_diverged, c, limit, on_max_skips),
        lambda c: None,
        consecutive,
    )


def _check_host_callbacks(limit: int, on_max_skips: OnMaxSkips) -> None:
    """JAX runs every host callback (`jax.debug.callback`, `io_callback`, `pure_callback`)
    through its CPU backend, on GPU and TPU too; a process whose ``JAX_PLATFORMS`` leaves cpu
    out (``JAX_PLATFORMS=cuda``) has none, and the callback would fail when the limit is
    reached instead of reporting it. Refuse that at trace time, naming the fix."""
    try:
        jax.devices("cpu")
    except RuntimeError as e:
        platforms = os.environ.get("JAX_PLATFORMS") or getattr(jax.config, "jax_platforms", None)
        raise RuntimeError(
            f"loss_scaled(max_consecutive_skips={limit}, on_max_skips={on_max_skips!r}): the "
            "report of a jitted step is a host callback, and JAX runs host callbacks through "
            f"its CPU backend, which this process did not start (JAX_PLATFORMS={platforms!r}). "
            "Add cpu to the platforms (JAX_PLATFORMS=cuda,cpu, or leave JAX_PLATFORMS unset), "
            "or pass on_max_skips='ignore' and read jaxamp.amp_info(opt_state)"
            ".consecutive_skips."
        ) from e


def loss_scaled(
    inner: Any,
    loss_scale: Any = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    max_consecutive_skips: int | None = None,
    on_max_skips: OnMaxSkips = "warn",
    param_labels: Any = None,
    in_place: bool = False,
    provenance: bool = False,
) -> LossScaledTransformation:
    """Wraps an optax optimizer for loss-scaled gradients, as `torch.amp.GradScaler` does.

    `update` takes the gradients of the *scaled* loss (float16, bfloat16, float32, or complex).
    It unscales them (torch's float32 reciprocal, exact at every scale; each leaf keeps its
    dtype), checks the unscaled gradients for inf/NaN and runs `inner` on them. A step is
    either applied completely or skipped completely: on a non-finite step the updates are
    -0.0 (the identity under `optax.apply_updates`) and `inner`'s state is kept bit for bit
    (Adam's count does not advance, as in torch). Then the scale is adjusted and the skip
    counters move. The decision is in-graph (a select fused into the update): no host sync.

    Where clipping and accumulation go, parameter groups, devices, and what a skipped step
    keeps per loss-scale type: the documentation page "Loss scaling".

    Args:
      inner: the optimizer to run on the unscaled gradients; with `param_labels`, a mapping
        from group label to optimizer (as `optax.multi_transform` takes).
      loss_scale: None (torch's `GradScaler` defaults: `DynamicLossScale.create()`), a preset
        name for `DynamicLossScale.from_preset`, or a loss scale object (jaxamp's or jmp's).
      axis_name: inside `shard_map`/`pmap`, the axis name(s) over which replicas must agree:
        every replica then skips if any replica saw a non-finite value. Leaving it out inside
        a mapped axis raises; ``axis_name=()`` lets each replica decide alone on purpose.
      max_consecutive_skips: report a run that skips this many steps in a row, or None.
        torch halves forever; a model that overflows in its forward pass never recovers.
      on_max_skips: "warn" (a `RuntimeWarning`), "raise" (`LossScaleDivergedError`), or
        "ignore" (read `amp_info`). The report comes once, at the step that reaches the limit,
        on CPU, GPU and TPU alike. Eagerly it is made by that call. Under `jit` (donated or
        not) it is a host callback inside that step: the warning has been issued once the
        step's outputs are ready; with "raise" the step fails, and reading its outputs
        (``jax.block_until_ready``, ``float(...)``) raises `jax.errors.JaxRuntimeError`
        carrying the message. JAX runs host callbacks on its CPU backend, so a jitted step
        with "warn"/"raise" refuses to trace where ``JAX_PLATFORMS`` leaves cpu out
        (``JAX_PLATFORMS=cuda``; ``cuda,cpu`` works). Under `jit` on GPU the report adds one
        scalar read by the host per step (the branch's predicate); "ignore" adds nothing.
      param_labels: a pytree of group labels shaped like the parameters, or a function of the
        parameters returning one (as `optax.multi_transform`): switches on a skip decision
        per group under one shared loss scale.
      in_place: True where the jitted step donates the parameters and the optimizer state
        (``jax.jit(step, donate_argnums=...)``): XLA then updates them in place. False (the
        default, for steps that do not donate) keeps every buffer copy out of applied steps.
        A wrong setting costs speed, never values (both forms compute the same bits); the
        documentation page "Loss scaling" says when each is faster.
      provenance: True records, on each skipped step, which gradient leaf first held inf or
        NaN and every leaf's headroom below float16's maximum (`AmpInfo.overflow`, an
        `OverflowProvenance`). Measured inside the skip branch only, so an applied step does
        no extra work (on GPU, where a branch syncs with the host, it is computed and
        selected every step). With ``axis_name``, combined across replicas. False (the
        default) leaves the state and the step exactly as without the option.

    Returns:
      A `GradientTransformationExtraArgs` whose state is a `LossScaledState`.

    Raises:
      ValueError: `inner` is already loss-scaled (here or, at `init`, anywhere inside it); at
        `update`, a mapped axis is in scope and `axis_name` was not given.

    Examples:
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jaxamp.loss_scaled(optax.adam(1e-3))  # torch's GradScaler rule by default
      >>> opt_state = tx.init(params)
      >>> scale = jaxamp.get_loss_scale(opt_state)
      >>> grads = scale.scale({"w": jnp.full(3, 0.5)})  # gradients of the scaled loss
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> params = jaxamp.apply_updates(params, updates, opt_state)
      >>> bool(jaxamp.amp_info(opt_state).last_step_applied)
      True
    """
    if isinstance(inner, LossScaledTransformation):
        raise ValueError(
            "loss_scaled(inner=...): inner is already loss-scaled; wrapping it again would "
            "unscale twice. Use one loss_scaled around the whole optimizer."
        )
    if param_labels is not None:
        inner = _group_transform(inner, param_labels)
    elif not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"loss_scaled(inner=...) takes an optax GradientTransformation; got "
            f"{type(inner).__name__} {inner!r}."
        )
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, (bool, np.bool_))
        or not isinstance(max_consecutive_skips, (int, np.integer))
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips must be None or an int >= 1; got {max_consecutive_skips!r}."
        )
    if on_max_skips not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_max_skips must be 'warn', 'raise' or 'ignore'; got {on_max_skips!r}.")
    if not isinstance(in_place, (bool, np.bool_)):
        raise TypeError(
            f"loss_scaled(in_place=...) takes a bool (True where the step donates params and "
            f"optimizer state); got {type(in_place).__name__} {in_place!r}."
        )
    if not isinstance(provenance, (bool, np.bool_)):
        raise TypeError(
            f"loss_scaled(provenance=...) takes a bool (True records which gradient leaf "
            f"overflowed on a skipped step); got {type(provenance).__name__} {provenance!r}."
        )
    scaler = _LossScaler(
        inner=optax.with_extra_args_support(inner),
        initial_loss_scale=as_loss_scale(loss_scale),
        axis_name=check_axis_name(axis_name, "loss_scaled"),
        max_consecutive_skips=(
            None if max_consecutive_skips is None else int(max_consecutive_skips)
        ),
        on_max_skips=on_max_skips,
        param_labels=param_labels,
        in_place=bool(in_place),
        provenance=bool(provenance),
    )
    return LossScaledTransformation(scaler.init, scaler.update)


@dataclasses.dataclass(frozen=True, eq=False)
class _LossScaler:
    """`loss_scaled`'s configuration and its step: `init`, `update` and `update_and_apply`.

    A step is: check the state and the mapped axes, unscale, decide and run `inner` (one
    decision for every leaf, or one per group with `param_labels`), then move the scale and
    the skip counters (`_next_state`).
    """

    inner: optax.GradientTransformationExtraArgs
    initial_loss_scale: Any
    axis_name: AxisName
    max_consecutive_skips: int | None
    on_max_skips: OnMaxSkips
    param_labels: Any
    in_place: bool = False
    provenance: bool = False

    def init(self, params: Any) -> LossScaledState:
        inner_state = self.inner.init(params)
        nested = list(loss_scaled_states(inner_state))
        if nested:
            raise ValueError(
                "loss_scaled(inner=...): inner already contains a loss-scaled optimizer at "
                f"{nested[0] or 'its top'}; wrapping it again would unscale twice. Use one "
                "loss_scaled around the whole optimizer."
            )
        group_applied = None
        if self.param_labels is not None:
            group_applied = jax.tree_util.tree_map(
                lambda _: jnp.array(True), _labels_for(self.param_labels, params)
            )
        return LossScaledState(
            inner_state=inner_state,
            # A copy per call: a step that donates this state deletes its buffers.
            loss_scale=fresh_buffers(self.initial_loss_scale),
            last_step_finite=jnp.array(True),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            group_applied=group_applied,
            overflow=no_overflow(leaf_paths(params)) if self.provenance else None,
        )

    def update(
        self, updates: Any, state: LossScaledState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScaledState]:
        return self._step(updates, state, params, extra_args, apply=False)

    def update_and_apply(
        self, grads: Any, state: LossScaledState, params: Any, **extra_args: Any
    ) -> tuple[Any, LossScaledState]:
        return self._step(grads, state, params, extra_args, apply=True)

    def _step(self, scaled_grads, state, params, extra_args, *, apply):
        # `update` returns the updates; `update_and_apply` the new parameters (the skip
        # decision then covers the parameters too).
        caller = "apply_gradients" if apply else "loss_scaled.update"
        if not isinstance(state, LossScaledState):
            raise TypeError(
                f"{caller}(state=...) takes the LossScaledState made by init; got "
                f"{type(state).__name__}. Was this state saved without loss scaling?"
            )
        if self.provenance != (state.overflow is not None):
            made = "with" if state.overflow is not None else "without"
            raise ValueError(
                f"{caller}(state=...): the state was made {made} provenance, but this optimizer "
                f"has loss_scaled(provenance={self.provenance}); initialise the state with the "
                "same optimizer (tx.init(params))."
            )
        check_replicas_agree(scaled_grads, self.axis_name, caller)
        unscale = _unscaler(state.loss_scale)
        if self.param_labels is None:
            out, inner_state, grads_finite, group_applied = self._one_decision(
                scaled_grads, unscale, state, params, extra_args, apply=apply
            )
        else:
            out, inner_state, grads_finite, group_applied = self._per_group_decisions(
                scaled_grads, unscale, state, params, extra_args, apply=apply
            )
        overflow = None
        if self.provenance:
            overflow = measure_overflow(
                grads_finite,
                scaled_grads,
                None if unscale is None else state.loss_scale.loss_scale,
                self.axis_name,
                state.overflow.paths,
                caller,
            )
        next_state = self._next_state(state, inner_state, grads_finite, group_applied)
        return out, next_state._replace(overflow=overflow)

    def _one_decision(self, scaled_grads, unscale, state, params, extra_args, *, apply):
        """One skip decision for every leaf: torch with one optimizer."""
        # The scaled gradients are checked element by element, and what reaches `inner` too
        # (with a scale below 1 unscaling may overflow); the unscaled gradients are
        # recomputed where they are read (the applied branch), never materialised.
        grads_finite = finite_after(scaled_grads, unscale, self.axis_name)
        out, inner_state = _skip_if_not(
            grads_finite,
            self.inner,
            unscale,
            scaled_grads,
            state.inner_state,
            params,
            extra_args,
            noop=unscale is None,
            apply=apply,
            in_place=self.in_place,
        )
        return out, inner_state, grads_finite, None

    def _per_group_decisions(self, scaled_grads, unscale, state, params, extra_args, *, apply):
        """A skip decision per `param_labels` group under one shared scale: torch with several
        optimizers and one `GradScaler`."""
        grads = scaled_grads if unscale is None else unscale(scaled_grads)
        updates, inner_state = self.inner.update(grads, state.inner_state, params, **extra_args)
        labels = _labels_for(self.param_labels, grads)
        # As `_one_decision`'s check: the scaled gradients element by element, and what
        # reaches `inner` too.
        group_finite = {
            label: finite_after(leaves, unscale, self.axis_name)
            for label, leaves in _leaves_per_group(scaled_grads, labels).items()
        }
        grads_finite = jnp.stack(list(group_finite.values())).all()
        group_applied = jax.tree_util.tree_map(lambda label: group_finite[label], labels)
        if apply:
            out = select_leaves(group_applied, optax.apply_updates(params, updates), params)
        else:
            out = skip_updates(group_applied, updates)
        inner_state = _select_groups(group_finite, inner_state, state.inner_state)
        return out, inner_state, grads_finite, group_applied

    def _next_state(self, state, inner_state, grads_finite, group_applied) -> LossScaledState:
        consecutive = jnp.where(
            grads_finite, jnp.zeros((), jnp.int32), optax.safe_increment(state.consecutive_skips)
        )
        limit = self.max_consecutive_skips
        if limit is not None and self.on_max_skips != "ignore":
            _report_at_limit(consecutive, limit, self.on_max_skips)
        return LossScaledState(
            inner_state=inner_state,
            loss_scale=state.loss_scale.adjust(grads_finite),
            last_step_finite=grads_finite,
            skipped_steps=count_if(~grads_finite, state.skipped_steps),
            consecutive_skips=consecutive,
            group_applied=group_applied,
        )


def _unscaler(loss_scale: Any) -> Any:
    """The unscaling function for `loss_scale`, or None where nothing is unscaled (NoOp: finite
    steps then equal an unwrapped run bit for bit)."""
    if isinstance(loss_scale, (NoOpLossScale, jmp.NoOpLossScale)):
        return None
    return unscaler(loss_scale.loss_scale)


def _skip_if_not(
    applied, inner, unscale, scaled_grads, inner_state, params, extra_args, *, noop, apply, in_place
):
    """Runs `inner.update` on the unscaled gradients where `applied`, else the identity.

    Returns ``(updates, inner_state)``, or with `apply` ``(new_params, inner_state)``: then
    the parameter update is inside the decision too, so a skipped step returns `params`
    itself (bit for bit) and an applied one fuses ``params + updates`` into the update.

    Eagerly (a concrete decision) the step runs op by op, exactly as an unwrapped eager step.
    Under `jit`, a select (the default): the new values where `applied`, the old ones kept bit
    for bit elsewhere. Without donation its outputs are fresh buffers, as an unscaled step's
    are (5 scalar copies in the benchmark MLP's program, none of a parameter or state buffer).
    With `in_place` (the step donates params and state) a branch (`lax.cond`) on CPU: the
    skipped branch passes the donated buffers through, so the applied one updates them in
    place (10 copies, against 26 for the select and 19-20 for Flax's and jmp's selects); but a
    branch output that may be an argument makes XLA copy every parameter and state buffer on
    every step when they are not donated (30 copies). Without scaling (`noop`) a select keeps
    finite steps bit-identical to an unwrapped jitted step. Every form computes the same
    values. `applied_step` and `skipped_step` say what each decision computes: a diagnostic
    only a skipped step needs goes into `skipped_step` (eagerly) and into a `lax.cond` on
    `applied` with small outputs (under `jit`), which costs nothing on applied steps.
    """

    def applied_step(inner_state, params):
        unscaled = scaled_grads if unscale is None else unscale(scaled_grads)
        updates, new_state = inner.update(unscaled, inner_state, params, **extra_args)
        return (optax.apply_updates(params, updates) if apply else updates), new_state

    def skipped_step(inner_state, params, out_shapes):
        return (params if apply else identity_updates(out_shapes)), inner_state

    if not isinstance(applied, jax.core.Tracer):
        if bool(applied):
            return applied_step(inner_state, params)
        out_shapes = jax.eval_shape(applied_step, inner_state, params)[0]
        return skipped_step(inner_state, params, out_shapes)

    def select():
        out, new_inner_state = applied_step(inner_state, params)
        out = select_tree(applied, out, params) if apply else skip_updates(applied, out)
        return out, select_tree(applied, new_inner_state, inner_state)

    if noop or not in_place:
        return select()
    out_shapes, state_shapes = jax.eval_shape(applied_step, inner_state, params)
    if _dtypes(state_shapes) != _dtypes(inner_state):
        # `inner` changes its state's dtypes (optax's Adam on float32 gradients of float16
        # parameters): a branch must return one type, a select promotes.
        return select()

    def branch():
        return jax.lax.cond(
            applied,
            lambda operands: applied_step(*operands),
            lambda operands: skipped_step(*operands, out_shapes),
            (inner_state, params),
        )

    # A select on GPU, where a branch would read its predicate on the host every step.
    return branch_or_select(branch=branch, select=select)


def _dtypes(tree: Any) -> list:
    return [getattr(x, "dtype", type(x)) for x in jax.tree_util.tree_leaves(tree)]


def _group_transform(transforms: Any, param_labels: Any) -> optax.GradientTransformation:
    if not isinstance(transforms, Mapping) or not all(
        isinstance(t, optax.GradientTransformation) for t in transforms.values()
    ):
        raise TypeError(
            "loss_scaled(inner=..., param_labels=...): with param_labels, inner must be a "
            "mapping from group label to optax GradientTransformation (as optax.multi_transform "
            f"takes); got {type(transforms).__name__}."
        )
    for label, tx in transforms.items():
        if isinstance(tx, LossScaledTransformation):
            raise ValueError(
                f"loss_scaled(inner=...): group {label!r} is already loss-scaled; with "
                "param_labels the one shared loss scale lives in this loss_scaled."
            )
    return optax.multi_transform(dict(transforms), param_labels)


def _labels_for(param_labels: Any, tree: Any) -> Any:
    return param_labels(tree) if callable(param_labels) else param_labels


def _leaves_per_group(grads: Any, labels: Any) -> dict[Any, list]:
    grad_leaves = jax.tree_util.tree_leaves(grads)
    label_leaves = jax.tree_util.tree_leaves(labels)
    if len(grad_leaves) != len(label_leaves):
        raise ValueError(
            f"loss_scaled(param_labels=...): {len(label_leaves)} labels for "
            f"{len(grad_leaves)} gradient leaves; give one label per parameter."
        )
    groups: dict[Any, list] = {}
    for label, leaf in zip(label_leaves, grad_leaves, strict=True):
        groups.setdefault(label, []).append(leaf)
    return groups


def _select_groups(group_finite: dict, new_state: Any, old_state: Any) -> Any:
    """Keeps each group's part of the multi_transform state where that group skipped."""
    inner_states = {
        label: select_tree(group_finite.get(label, True), new, old_state.inner_states[label])
        for label, new in new_state.inner_states.items()
    }
    return new_state._replace(inner_states=inner_states)


def apply_updates(params: Any, updates: Any, opt_state: Any) -> Any:
    """`optax.apply_updates`, keeping the parameters of a skipped step (or group) bit for bit.

    `optax.apply_updates(params, updates)` with `loss_scaled`'s -0.0 updates keeps every normal
    parameter, but on CPU and TPU any arithmetic flushes subnormal parameters to zero; this
    selects the old value instead (the Flax glue uses it). The decision is the one
    `loss_scaled` made (`amp_info(opt_state).last_step_applied`, or per group).

    Args:
      params: the parameters the updates were computed for.
      updates: the updates `loss_scaled(...).update` returned.
      opt_state: the optimizer state that `update` returned with them.

    Returns:
      The new parameters, each leaf in its own dtype.

    Examples:
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(params)
      >>> grads = {"w": jnp.array([jnp.nan, 1.0, 1.0])}
      >>> updates, opt_state = tx.update(grads, opt_state, params)
      >>> jaxamp.apply_updates(params, updates, opt_state)["w"]  # skipped: unchanged
      Array([1., 1., 1.], dtype=float32)
    """
    state = unwrap_variables(one_state(opt_state, "apply_updates"))
    check_outermost(opt_state, find_states_with_keys(opt_state), "apply_updates")
    new_params = optax.apply_updates(params, updates)
    if state.group_applied is None:
        return select_tree(state.last_step_finite, new_params, params)
    return select_leaves(state.group_applied, new_params, params)


def apply_gradients(
    tx: Any, grads: Any, opt_state: Any, params: Any, *, policy: Any = None, **extra_args: Any
) -> tuple[Any, Any]:
    """One optimizer step of a loss-scaled optimizer: ``tx.update`` then `apply_updates`, as
    one decision.

    For `loss_scaled(...)` this is `LossScaledTransformation.update_and_apply`: the parameter
    update goes inside the skip decision, so under `jit` on CPU it fuses into the optimizer's
    update as in a step without loss scaling, where ``update`` followed by `apply_updates`
    writes the updates out and reads them back (BENCHMARKS.md). The values are those of
    ``update`` + `apply_updates`; a skipped step returns `params` bit for bit.
    A transformation that wraps one `loss_scaled` whole (`jaxamp.multi_steps`,
    `optax.inject_hyperparams`) gets ``update`` + `apply_updates`; one
    with a `loss_scaled` per `optax.multi_transform` group, ``update`` +
    `optax.apply_updates` (each skipped group's updates are -0.0).

    Args:
      tx: the optimizer: `jaxamp.loss_scaled(...)`, or a transformation around it.
      grads: the gradients of the scaled loss (as `jaxamp.value_and_grad` returns them).
      opt_state: `tx`'s state.
      params: the parameters the gradients were computed for.
      policy: the step's `jaxamp.Policy` (or a name), as given to `jaxamp.value_and_grad`:
        parameters narrower than its param dtype are refused (float16 master weights under
        "fp16-mixed": small updates vanish in float16, and torch refuses to unscale float16
        gradients). None checks nothing (pure float16 training, "fp16-true", is legitimate).
      **extra_args: extra arguments for ``tx.update`` (e.g. ``value=`` for line searches).

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      TypeError: `tx` is not an optax transformation, or holds no loss scaling (a plain
        optimizer would apply the gradients still scaled: wrap it in `jaxamp.loss_scaled`);
        a parameter is narrower than `policy`'s param dtype.
      ValueError: `params` is None, or the loss-scaled optimizer is not the outermost
        transformation (e.g. ``optax.chain(clip, loss_scaled(sgd))``: the clip would see
        scaled gradients; put the chain inside: ``loss_scaled(optax.chain(clip, sgd))``).

    Examples:
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.5))
      >>> opt_state = tx.init(params)
      >>> grads = jaxamp.get_loss_scale(opt_state).scale({"w": jnp.ones(3)})
      >>> params, opt_state = jaxamp.apply_gradients(tx, grads, opt_state, params)
      >>> params["w"]
      Array([0.5, 0.5, 0.5], dtype=float32)
      >>> bad = {"w": jnp.array([jnp.inf, 1.0, 1.0])}
      >>> jaxamp.apply_gradients(tx, bad, opt_state, params)[0]["w"]  # skipped: unchanged
      Array([0.5, 0.5, 0.5], dtype=float32)
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"apply_gradients(tx=...) takes an optax GradientTransformation; got "
            f"{type(tx).__name__} {tx!r}."
        )
    if params is None:
        raise ValueError(
            "apply_gradients(params=None): the parameters are needed to apply the update; "
            "pass the parameters the gradients were computed for."
        )
    if policy is not None:
        _check_param_dtypes(params, get_policy(policy))
    if isinstance(tx, LossScaledTransformation):
        return tx.update_and_apply(grads, opt_state, params, **extra_args)
    found = find_states_with_keys(opt_state)
    if not found:
        raise TypeError(
            "apply_gradients(tx=...): tx is not loss-scaled (its state holds no "
            f"LossScaledState; got {type(opt_state).__name__}), so the gradients of the scaled "
            "loss would be applied still multiplied by the scale, and an inf/NaN step would "
            "not be skipped. Wrap the optimizer: tx = jaxamp.loss_scaled(optax.adam(1e-3)) "
            "(jaxamp.loss_scaled(tx, jaxamp.NoOpLossScale()) where no scaling is meant)."
        )
    check_outermost(opt_state, found, "apply_gradients")
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra_args)
    if len(found) == 1:
        return apply_updates(params, updates, new_opt_state), new_opt_state
    # One loss scale per multi_transform group: each skipped group's updates are -0.0.
    return optax.apply_updates(params, updates), new_opt_state


_FLOATS = tuple(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def _check_param_dtypes(params: Any, policy: Policy) -> None:
    # The rule `jaxamp.value_and_grad` applies: the policy's param dtype or wider.
    allowed = {
        d
        for d in _FLOATS
        if d == policy.param_dtype or d.itemsize > np.dtype(policy.param_dtype).itemsize
    }
    check_param_dtypes(
        params,
        lambda _: allowed,
        policy,
        "apply_gradients(params=...)",
        fix="Fix: keep float32 master weights and let the policy cast them for compute "
        "(jaxamp.value_and_grad(loss_fn, policy=...)), or cast them: "
        "policy.cast_to_param(params).",
    )
