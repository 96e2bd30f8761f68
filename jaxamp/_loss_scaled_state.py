"""The state of `loss_scaled` and the queries on it: `LossScaledState`, `AmpInfo`, `amp_info`,
`get_loss_scale`, `set_loss_scale`, `loss_scaled_states`.

One vocabulary: `jaxamp.loss_scaled` makes a `LossScaledState`; `loss_scaled_states` finds every
one inside a larger optimizer state; `amp_info` summarises one as an `AmpInfo` (scalars to log).
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._loss_scale import LossScale, as_loss_scale
from jaxamp._provenance import OverflowProvenance

__all__ = [
    "AmpInfo",
    "LossScaledState",
    "amp_info",
    "check_outermost",
    "find_states_with_keys",
    "get_loss_scale",
    "loss_scaled_states",
    "one_state",
    "set_loss_scale",
    "unwrap_variables",
]


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    One vocabulary: `loss_scaled` makes a `LossScaledState`; `loss_scaled_states` finds every
    one inside a larger optimizer state; `amp_info` summarises one as an `AmpInfo` (scalars to
    log).

    Attributes:
      inner_state: the wrapped optimizer's state; bit-for-bit unchanged on a skipped step.
      loss_scale: the current loss scale (a `DynamicLossScale`, `StaticLossScale`,
        `NoOpLossScale` or a jmp loss scale).
      last_step_finite: whether the last step's gradients were finite (and so applied).
      skipped_steps: total skipped steps (int32, saturating).
      consecutive_skips: skipped steps in a row up to now (int32, saturating).
      group_applied: with ``param_labels`` (one shared scale, a skip decision per group), a
        tree shaped like the parameters of scalar bools: whether each leaf's group applied
        the last step; None otherwise (one decision for every leaf: `last_step_finite`).
      overflow: with ``provenance=True``, the last step's `OverflowProvenance` (which leaf
        overflowed first, each leaf's headroom); None otherwise, so a state without it has
        exactly the leaves it always had (checkpoints unchanged).

    Examples:
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(params)
      >>> isinstance(opt_state, jaxamp.LossScaledState)
      True
      >>> float(opt_state.loss_scale.loss_scale), int(opt_state.skipped_steps)
      (65536.0, 0)
    """

    inner_state: optax.OptState
    loss_scale: Any
    last_step_finite: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    group_applied: Any = None
    overflow: OverflowProvenance | None = None


def _state_children(state: LossScaledState) -> tuple[tuple[str, ...], bool]:
    # `overflow` is a child only with provenance: without it the state flattens to the fields
    # it always had, so checkpoints (orbax compares tree structures, None fields included)
    # written before the field existed still load.
    with_overflow = state.overflow is not None
    return (LossScaledState._fields if with_overflow else LossScaledState._fields[:-1]), (
        with_overflow
    )


def _flatten_state_with_keys(state: LossScaledState) -> tuple[list, bool]:
    names, with_overflow = _state_children(state)
    return [(jax.tree_util.GetAttrKey(n), getattr(state, n)) for n in names], with_overflow


def _flatten_state(state: LossScaledState) -> tuple[list, bool]:
    names, with_overflow = _state_children(state)
    return [getattr(state, n) for n in names], with_overflow


jax.tree_util.register_pytree_with_keys(
    LossScaledState,
    _flatten_state_with_keys,
    lambda with_overflow, children: LossScaledState(*children),
    _flatten_state,
)


class AmpInfo(NamedTuple):
    """In-graph telemetry from `amp_info`: a `LossScaledState` summarised, every field a scalar
    array (log it, no sync needed).

    Attributes:
      loss_scale: the current loss scale (float32).
      last_step_finite: whether every gradient of the last step was finite (the scale then
        counts a clean step; otherwise it backs off).
      last_step_applied: whether the last step updated the parameters. With one decision for
        every leaf this equals `last_step_finite` (a non-finite step is skipped whole); with
        ``param_labels`` it is true when at least one group applied its update, while
        `last_step_finite` is false as soon as one group overflowed.
      skipped_steps: total skipped steps.
      consecutive_skips: skipped steps in a row, ending with the last step.
      overflow: with ``loss_scaled(..., provenance=True)``, an `OverflowProvenance`: on a
        skipped step the path of the first gradient leaf that held inf or NaN and each leaf's
        headroom below float16's maximum (``overflow.leaf_path()``,
        ``overflow.headroom_by_path()``); None without provenance.

    Examples:
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(params)
      >>> info = jaxamp.amp_info(opt_state)
      >>> float(info.loss_scale), int(info.skipped_steps)
      (65536.0, 0)
    """

    loss_scale: jax.Array
    last_step_finite: jax.Array
    last_step_applied: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    overflow: OverflowProvenance | None = None


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaledState)


def _find_states(opt_state: Any) -> list[tuple[str, LossScaledState]]:
    return [(jax.tree_util.keystr(path), state) for path, state in find_states_with_keys(opt_state)]


def find_states_with_keys(opt_state: Any) -> list[tuple[tuple, LossScaledState]]:
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state, is_leaf=_is_state):
        if _is_state(leaf):
            found.append((path, leaf))
    return found


def check_outermost(opt_state: Any, found: list[tuple[tuple, Any]], caller: str) -> None:
    """Raises if a loss-scaled state sits in a chain beside other transformations' states.

    `optax.chain`'s state is a plain tuple (`optax.named_chain`'s an OrderedDict), one entry
    per transformation; `optax.multi_transform` keeps its groups' states in a dict too, but
    each group sees only its own parameters' gradients, so that one is fine.
    """
    for path, _ in found:
        container, parent = opt_state, None
        for key in path:
            chained = (type(container) in (tuple, list)) or (
                type(container) in (dict, collections.OrderedDict)
                and not isinstance(parent, optax.MultiTransformState)
            )
            if chained and len(container) > 1:
                where = jax.tree_util.keystr(path)
                raise ValueError(
                    f"{caller}(opt_state=...): the loss-scaled optimizer's state is at {where}, "
                    f"beside {len(container) - 1} other transformation(s) in a chain: they see "
                    "the *scaled* gradients (a clip clips gradients 65536x too large) and keep "
                    "stepping when loss_scaled skips. Make loss_scaled the outermost "
                    "transformation: jaxamp.loss_scaled(optax.chain(optax.clip_by_global_norm("
                    "1.0), optax.sgd(0.1))), not optax.chain(optax.clip_by_global_norm(1.0), "
                    "jaxamp.loss_scaled(optax.sgd(0.1)))."
                )
            child = _child(container, key)
            if child is _NOT_FOUND:
                break
            container, parent = child, container


_NOT_FOUND = object()


def _child(container: Any, key: Any) -> Any:
    try:
        if isinstance(key, jax.tree_util.SequenceKey):
            return container[key.idx]
        if isinstance(key, jax.tree_util.DictKey):
            return container[key.key]
        if isinstance(key, jax.tree_util.GetAttrKey):
            return getattr(container, key.name)
    except (KeyError, IndexError, TypeError, AttributeError):
        pass
    return _NOT_FOUND  # a custom node (e.g. a flax.nnx State): stop walking


def _is_variable(x: Any) -> bool:
    # flax.nnx keeps optimizer state in Variables; read their values rather than import nnx.
    return hasattr(x, "get_value") and not isinstance(x, jax.Array)


def _unwrap_variable(x: Any) -> Any:
    return x.get_value() if _is_variable(x) else x


def get_loss_scale(opt_state: Any) -> Any:
    """Returns the current loss scale held anywhere inside an optax state.

    Finds the `LossScaledState` of `loss_scaled` inside `jaxamp.multi_steps`, `MultiSteps`,
    `inject_hyperparams` and other nested states. A loss scale object passed in is returned as is.

    Raises:
      ValueError: no loss-scaled state is found, or several are (one per `multi_transform`
        group): then pick one with `jaxamp.loss_scaled_states(opt_state)`; or it sits in a chain
        beside other transformations (they would see scaled gradients: make `loss_scaled`
        the outermost transformation).

    Examples:
      >>> tx = jaxamp.multi_steps(jaxamp.loss_scaled(optax.sgd(0.1)), 4)
      >>> opt_state = tx.init({"w": jnp.ones(2)})
      >>> float(jaxamp.get_loss_scale(opt_state).loss_scale)
      65536.0
    """
    if isinstance(opt_state, LossScale) and not isinstance(opt_state, LossScaledState):
        return opt_state
    loss_scale = one_state(opt_state, "get_loss_scale").loss_scale
    check_outermost(opt_state, find_states_with_keys(opt_state), "get_loss_scale")
    return jax.tree_util.tree_map(_unwrap_variable, loss_scale, is_leaf=_is_variable)


def loss_scaled_states(opt_state: Any) -> dict[str, LossScaledState]:
    """Every `LossScaledState` inside `opt_state`, keyed by its path (e.g. ``"[0]"``).

    The states `loss_scaled` made (one per `optax.multi_transform` group that has its own);
    `amp_info` summarises one of them as an `AmpInfo`.

    Examples:
      >>> tx = optax.multi_transform(
      ...     {"a": jaxamp.loss_scaled(optax.sgd(0.1)), "b": jaxamp.loss_scaled(optax.adam(0.1))},
      ...     {"w": "a", "v": "b"},
      ... )
      >>> states = jaxamp.loss_scaled_states(tx.init({"w": jnp.ones(2), "v": jnp.ones(2)}))
      >>> list(states)
      [".inner_states['a'].inner_state", ".inner_states['b'].inner_state"]
      >>> float(jaxamp.amp_info(states[".inner_states['a'].inner_state"]).loss_scale)
      65536.0
    """
    return dict(_find_states(opt_state))


def one_state(opt_state: Any, caller: str) -> LossScaledState:
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
            "jaxamp.loss_scaled_states(opt_state)."
        )
    return found[0][1]


def set_loss_scale(opt_state: Any, loss_scale: Any) -> Any:
    """Returns `opt_state` with its loss scale replaced (e.g. to reset it after a restore).

    Examples:
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(params)
      >>> opt_state = jaxamp.set_loss_scale(opt_state, jaxamp.StaticLossScale(128.0))
      >>> float(jaxamp.get_loss_scale(opt_state).loss_scale)
      128.0
    """
    loss_scale = as_loss_scale(loss_scale, "set_loss_scale")
    one_state(opt_state, "set_loss_scale")

    def replace(x):
        return x._replace(loss_scale=loss_scale) if _is_state(x) else x

    return jax.tree_util.tree_map(replace, opt_state, is_leaf=_is_state)


def unwrap_variables(state: LossScaledState) -> LossScaledState:
    return jax.tree_util.tree_map(_unwrap_variable, state, is_leaf=_is_variable)


def amp_info(opt_state: Any) -> AmpInfo:
    """In-graph telemetry of the loss-scaled optimizer inside `opt_state`.

    Returns:
      An `AmpInfo` of scalar arrays: the current scale, whether the last step was finite and
      applied, and total and consecutive skipped steps. Cheap under `jit`; log it.

    Examples:
      >>> params = {"w": jnp.ones(3)}
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(params)
      >>> grads = {"w": jnp.array([1.0, jnp.inf, 0.0])}  # an overflowing step
      >>> _, opt_state = tx.update(grads, opt_state, params)
      >>> info = jaxamp.amp_info(opt_state)
      >>> float(info.loss_scale), bool(info.last_step_applied), int(info.skipped_steps)
      (32768.0, False, 1)
    """
    state = unwrap_variables(one_state(opt_state, "amp_info"))
    return AmpInfo(
        loss_scale=jnp.asarray(state.loss_scale.loss_scale, jnp.float32),
        last_step_finite=state.last_step_finite,
        last_step_applied=_any_group_applied(state),
        skipped_steps=state.skipped_steps,
        consecutive_skips=state.consecutive_skips,
        overflow=state.overflow,
    )


def _any_group_applied(state: LossScaledState) -> jax.Array:
    groups = jax.tree_util.tree_leaves(state.group_applied)
    if not groups:  # one decision for every leaf
        return state.last_step_finite
    return jnp.stack(groups).any()
