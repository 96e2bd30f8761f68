"""Overflow provenance for ``loss_scaled(..., provenance=True)``: which gradient leaf first held
a non-finite value on a skipped step, and how far each leaf's largest scaled gradient sits below
float16's maximum.

Measured on skipped steps only. Under `jit` the measurement is the skip side of a `lax.cond` on
the step's finiteness, whose other side returns constants: an applied step makes no extra pass
over the gradients. Where a branch costs a device-to-host sync per step (XLA:GPU,
`branch_or_select`) it is computed every step and selected, as `loss_scaled`'s skip is there.
Eagerly the decision is concrete and a Python branch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._numerics import (
    AxisName,
    bits_dtype,
    branch_or_select,
    full_like_shapes,
    is_inexact_leaf,
    leaf_finite,
    unscaler,
)

F16_MAX = float(np.finfo(np.float16).max)  # 65504
_LOG2_F16_MAX = np.float32(np.log2(F16_MAX))
_NONE = -1  # overflow_leaf when no leaf held a non-finite value


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["overflow_leaf", "headroom"],
    meta_fields=["paths"],
)
@dataclasses.dataclass(frozen=True)
class OverflowProvenance:
    """Where the last step's overflow came from: ``amp_info(opt_state).overflow`` of a
    ``loss_scaled(..., provenance=True)`` optimizer.

    Leaves are numbered in ``jax.tree_util.tree_leaves(grads)`` order; `paths` names them.

    Attributes:
      overflow_leaf: int32 scalar: the first gradient leaf that held inf or NaN on the last
        step (scaled, or once unscaled with a scale below 1: the check that skipped the step);
        -1 when the last step was finite. Across replicas (``axis_name``) the first over all
        replicas.
      headroom: float32, one entry per gradient leaf: log2(float16 max / the leaf's largest
        |scaled gradient|) on the last skipped step, the number of doublings of the loss scale
        the leaf had left before float16 overflows (negative: beyond float16's range already).
        -inf for a leaf holding inf or NaN, +inf for an all-zero, empty or non-float leaf (and,
        where the backend flushes subnormals, as CPUs and TPUs do, for a leaf whose largest
        magnitude is below float32's smallest normal, 2**-126).
        Across replicas the smallest. All +inf after a finite step: nothing is measured then.
      paths: the leaves' `jax.tree_util.keystr` paths (static: not arrays).

    Examples:
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1), provenance=True)
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
      >>> grads = {"a": jnp.array([1024.0, 0.5]), "b": jnp.array([1.0, jnp.inf])}
      >>> _, opt_state = tx.update(grads, tx.init(params), params)
      >>> overflow = jaxamp.amp_info(opt_state).overflow
      >>> overflow.leaf_path(), overflow.headroom_by_path()
      ("['b']", {"['a']": 5.99..., "['b']": -inf})
    """

    overflow_leaf: jax.Array
    headroom: jax.Array
    paths: tuple[str, ...]

    def leaf_path(self) -> str | None:
        """The path of `overflow_leaf`, or None after a finite step (reads the value: a sync).

        Raises:
          TypeError: the record is stacked or replicated (pick one first, e.g.
            ``jax.tree.map(lambda x: x[0], overflow)``).
        """
        index = _host_scalar(self.overflow_leaf, "leaf_path")
        return None if index < 0 else self.paths[index]

    def headroom_by_path(self) -> dict[str, float]:
        """`headroom` as ``{path: float}`` (reads the values: a sync)."""
        values = np.asarray(self.headroom)
        if values.shape != (len(self.paths),):
            raise TypeError(
                f"OverflowProvenance.headroom_by_path: headroom has shape {values.shape}, not "
                f"({len(self.paths)},): a stacked or replicated record; pick one first, e.g. "
                "jax.tree.map(lambda x: x[0], overflow)."
            )
        return {path: float(v) for path, v in zip(self.paths, values, strict=True)}


def _host_scalar(x: Any, caller: str) -> int:
    value = np.asarray(x)
    if value.shape != ():
        raise TypeError(
            f"OverflowProvenance.{caller}: overflow_leaf has shape {value.shape}, not (): a "
            "stacked or replicated record; pick one first, e.g. "
            "jax.tree.map(lambda x: x[0], overflow)."
        )
    return int(value)


def leaf_paths(tree: Any) -> tuple[str, ...]:
    """The `keystr` path of every leaf of `tree`, in `tree_leaves` order."""
    return tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree))


def no_overflow(paths: tuple[str, ...]) -> OverflowProvenance:
    """The record of a finite step (and of `init`): no leaf, +inf headroom everywhere."""
    return OverflowProvenance(
        overflow_leaf=jnp.asarray(_NONE, jnp.int32),
        headroom=jnp.full((len(paths),), np.inf, jnp.float32),
        paths=paths,
    )


def _log2_of_bits(bits: jax.Array, dtype: np.dtype) -> jax.Array:
    """log2 of the non-negative float whose bits are `bits`, in float32, subnormals included.

    Read from the exponent and significand fields: arithmetic on a subnormal float32 or
    bfloat16 value is flushed to zero on CPU and TPU (log2 would say -inf: an all-zero leaf).
    """
    finfo = jnp.finfo(dtype)
    nmant, bias = int(finfo.nmant), 1 - int(finfo.minexp)
    exponent = (bits >> nmant).astype(jnp.int32)
    significand = (bits & ((1 << nmant) - 1)).astype(jnp.float32)
    normal = (exponent - bias).astype(jnp.float32) + jnp.log2(
        jnp.float32(1.0) + significand * jnp.float32(2.0**-nmant)
    )
    subnormal = jnp.log2(significand) + jnp.float32(1 - bias - nmant)  # log2(0) = -inf
    return jnp.where(exponent == 0, subnormal, normal)


def _headroom_and_finite(x: jax.Array, scale: Any, unscale: Any) -> tuple[jax.Array, jax.Array]:
    """(headroom, finite) of one real float array, `finite` as `finite_after` decides it: every
    element finite, and (where a scale below 1 is removed, by `unscale`) every element finite
    unscaled.

    From the array's maximum and minimum alone, reduced from the values themselves: XLA:CPU
    writes out any array computed on the way into a long reduction (a sign mask, a bitcast),
    and inside the skip branch such buffers, one per leaf, enlarged the program's temporary
    arena, which every step allocates: finite steps paid ~20% for a branch they never run.
    XLA's maximum and minimum propagate NaN. Unscaling rounds monotonically, so the elements
    stay finite unscaled exactly when the largest magnitude does: only that one is unscaled.
    """
    hi, lo = jnp.max(x), jnp.min(x)
    bits = bits_dtype(x.dtype)
    if bits is None:  # floats without infinities (fp8)
        largest = jnp.maximum(jnp.abs(hi.astype(jnp.float32)), jnp.abs(lo.astype(jnp.float32)))
        scaled_finite = jnp.isfinite(largest)
        log2_largest = jnp.log2(largest)
        largest = largest.astype(x.dtype)
    else:
        # |hi| and |lo| compared as bits with the sign cleared: exact, never flushed, and NaN
        # (above inf as bits) counts as non-finite.
        mask = np.array(np.iinfo(bits).max >> 1, bits)
        largest_bits = jnp.maximum(
            jax.lax.bitcast_convert_type(hi, bits) & mask,
            jax.lax.bitcast_convert_type(lo, bits) & mask,
        )
        scaled_finite = largest_bits < np.array(np.inf, x.dtype).view(bits)
        log2_largest = _log2_of_bits(largest_bits, x.dtype)
        largest = jax.lax.bitcast_convert_type(largest_bits, x.dtype)
    finite = scaled_finite
    if scale is not None:
        keeps = jnp.asarray(scale, jnp.float32) >= 1
        unscaled_finite = jnp.logical_or(keeps, leaf_finite(unscale(largest)))
        finite = jnp.logical_and(finite, unscaled_finite)
    # The headroom of the scaled values: finite for a leaf that overflows only once unscaled.
    headroom = jnp.where(scaled_finite, _LOG2_F16_MAX - log2_largest, jnp.float32(-np.inf))
    return headroom, finite


def _leaf_measure(x: Any, scale: Any, unscale: Any) -> tuple[jax.Array, jax.Array]:
    """(headroom, finite) of one gradient leaf (complex: the worse of its two parts)."""
    if not is_inexact_leaf(x):
        return jnp.float32(np.inf), jnp.array(True)
    x = jnp.asarray(x)
    if x.size == 0:
        return jnp.float32(np.inf), jnp.array(True)
    parts = [x.real, x.imag] if jnp.issubdtype(x.dtype, jnp.complexfloating) else [x]
    measured = [_headroom_and_finite(part, scale, unscale) for part in parts]
    headroom = functools.reduce(jnp.minimum, [h for h, _ in measured])
    finite = functools.reduce(jnp.logical_and, [f for _, f in measured])
    return headroom, finite


def _measure(
    scaled_grads: Any, scale: Any, axis_name: AxisName = None
) -> tuple[jax.Array, jax.Array]:
    """(overflow_leaf, headroom) of `scaled_grads` unscaled by `scale` (None: not unscaled)."""
    leaves = jax.tree_util.tree_leaves(scaled_grads)
    n = len(leaves)
    if not leaves:
        return jnp.asarray(_NONE, jnp.int32), jnp.zeros((0,), jnp.float32)
    unscale = None if scale is None else unscaler(scale)  # one reciprocal for every leaf
    measured = [_leaf_measure(x, scale, unscale) for x in leaves]
    headroom = jnp.stack([h for h, _ in measured]).astype(jnp.float32)
    finite = jnp.stack([f for _, f in measured])
    # `n` (past the last leaf) where every leaf is finite, so a minimum picks the first.
    first = jnp.where(finite.all(), n, jnp.argmax(~finite)).astype(jnp.int32)
    if axis_name is not None and axis_name != ():
        first = jax.lax.pmin(first, axis_name)
        headroom = jax.lax.pmin(headroom, axis_name)
    return jnp.where(first == n, jnp.int32(_NONE), first), headroom


# Eagerly one compiled program per gradient structure, not dozens of dispatched operations.
_measure_eagerly = jax.jit(_measure)


def measure_overflow(
    grads_finite: Any,
    scaled_grads: Any,
    scale: Any,
    axis_name: AxisName,
    paths: tuple[str, ...],
    caller: str,
) -> OverflowProvenance:
    """The step's `OverflowProvenance`: measured where `grads_finite` is false, else
    `no_overflow`'s values.

    Args:
      grads_finite: the step's decision (a bool or a scalar bool array, agreed across
        replicas where `axis_name` names axes).
      scaled_grads: the gradients `loss_scaled.update` received.
      scale: the loss scale value they are unscaled by (None: not unscaled, `NoOpLossScale`).
      axis_name: the mapped axes to combine over (first leaf: smallest index; headroom:
        smallest).
      paths: the state's leaf paths (`leaf_paths` of the parameters at `init`).
      caller: for the error message.
    """
    n = len(jax.tree_util.tree_leaves(scaled_grads))
    if n != len(paths):
        raise ValueError(
            f"{caller}: the gradients have {n} leaves but the state's overflow record was made "
            f"for {len(paths)} (the parameters given to init: {list(paths)[:6]}...); pass "
            "gradients shaped like the parameters the optimizer was initialised with."
        )

    def measure(grads):
        return _measure(grads, scale, axis_name)

    if not isinstance(grads_finite, jax.core.Tracer):
        if bool(grads_finite):
            return no_overflow(paths)
        return OverflowProvenance(*_measure_eagerly(scaled_grads, scale), paths=paths)

    def select():
        leaf, headroom = measure(scaled_grads)
        return (
            jnp.where(grads_finite, jnp.int32(_NONE), leaf),
            jnp.where(grads_finite, jnp.float32(np.inf), headroom),
        )

    leaf_shape, headroom_shape = jax.eval_shape(measure, scaled_grads)

    def nothing(grads):
        return full_like_shapes(leaf_shape, _NONE), full_like_shapes(headroom_shape, np.inf)

    def branch():
        return jax.lax.cond(grads_finite, nothing, measure, scaled_grads)

    leaf, headroom = branch_or_select(branch=branch, select=select)
    return OverflowProvenance(overflow_leaf=leaf, headroom=headroom, paths=paths)
