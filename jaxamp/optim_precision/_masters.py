"""bf16 (or float16) parameters without float32 masters that still learn: stochastic rounding of
the parameter update (torchao's ``bf16_stochastic_round``) or Kahan-compensated updates (optimi,
AnyPrecisionAdamW)."""

from __future__ import annotations

import difflib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._numerics import eager_as_one_program, fresh_buffers, widen
from jaxamp._optim import LossScaledTransformation
from jaxamp._policy import Policy, get_policy
from jaxamp.optim_precision._state import _is_float_array, like_stored, to_compute

__all__ = [
    "PRESETS",
    "KahanSummationState",
    "StochasticRoundingState",
    "kahan_summation",
    "preset",
    "stochastic_round",
    "stochastic_rounding",
]

_LOW_16 = np.uint32(0xFFFF)
_HIGH_16 = np.uint32(0xFFFF0000)
_BF16_ULP = np.uint32(0x10000)


@eager_as_one_program
def _round_bf16(x32: jax.Array, random16: jax.Array) -> jax.Array:
    """torchao's ``_fp32_to_bf16_sr`` given its 16 random bits: away from zero when the random
    value is below the 16 bits bfloat16 drops (probability: those bits / 2**16)."""
    bits = jax.lax.bitcast_convert_type(x32, jnp.uint32)
    toward_zero = bits & _HIGH_16
    rounded = jnp.where(random16 < (bits & _LOW_16), toward_zero + _BF16_ULP, toward_zero)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
    # A NaN whose payload sits in the low bits would truncate to inf: keep it NaN.
    return jnp.where(jnp.isnan(x32), x32.astype(jnp.bfloat16), out)


@functools.partial(eager_as_one_program, static_argnames="dtype")
def _round_between_neighbours(x32: jax.Array, uniform: jax.Array, dtype: Any) -> jax.Array:
    """Any narrower float: the two neighbours of x, the upper one with probability
    (x - lower) / (upper - lower). Values that overflow round to nearest (inf), as a cast does."""
    # `widen`: XLA:GPU would otherwise delete the float32 -> dtype -> float32 round trip (its
    # excess precision), find every value exact and round each to nearest.
    nearest = x32.astype(dtype)
    nearest32 = widen(nearest)
    above = nearest32 > x32
    toward = jnp.where(above, -jnp.inf, jnp.inf).astype(dtype)
    other = jnp.nextafter(nearest, toward)
    lower = jnp.where(above, other, nearest)
    upper = jnp.where(above, nearest, other)
    lower32, upper32 = widen(lower), widen(upper)
    p_upper = (x32 - lower32) / (upper32 - lower32)
    out = jnp.where(uniform < p_upper, upper, lower)
    exact = (nearest32 == x32) | ~jnp.isfinite(nearest)
    return jnp.where(exact, nearest, out)


def stochastic_round(x: jax.Array, key: jax.Array, dtype: Any = jnp.bfloat16) -> jax.Array:
    """Rounds `x` to `dtype` up or down at random, so that the mean of the result is `x`.

    For bfloat16 it is torchao's ``_fp32_to_bf16_sr``: a float32 value rounds away from zero with
    probability (its low 16 bits) / 2**16, from 16 random bits per element (the same bits give
    the same result as torchao). For float16 the two neighbours are picked with probability
    proportional to closeness. float32 (and wider) targets round to nearest: `x` is computed in
    float32, so there is nothing to round.

    Args:
      x: a floating array (computed in float32).
      key: a JAX PRNG key (``jax.random.key(0)`` or ``jax.random.PRNGKey(0)``).
      dtype: the target dtype: bfloat16 (default), float16, or float32.

    Returns:
      An array of `dtype`. Infinities stay, NaN stays NaN; a value beyond the dtype's largest
      finite value may round to inf.

    Examples:
      >>> x = jnp.full(10_000, 1.0 + 2.0**-9)  # a quarter of the way from 1 to the next bf16
      >>> y = jaxamp.optim_precision.stochastic_round(x, jax.random.key(0))
      >>> y.dtype, sorted(set(y.tolist()))
      (dtype(bfloat16), [1.0, 1.0078125])
      >>> round(float(y.astype(jnp.float32).mean()), 4)  # unbiased: 1 + 2**-9 = 1.00195...
      1.002
    """
    if not _is_float_array(jnp.asarray(x)):
        raise TypeError(f"stochastic_round(x=...) takes a floating array; got {x!r}.")
    dtype = np.dtype(dtype)
    allowed = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
    if dtype not in allowed:
        raise ValueError(f"stochastic_round(dtype={dtype}): must be bfloat16, float16 or float32.")
    x32 = jnp.asarray(x).astype(jnp.float32)
    if dtype == np.dtype(jnp.float32):
        return x32
    if dtype == np.dtype(jnp.bfloat16):
        random16 = jax.random.bits(key, x32.shape, jnp.uint32) >> np.uint32(16)
        return _round_bf16(x32, random16)
    return _round_between_neighbours(x32, jax.random.uniform(key, x32.shape), dtype)


class StochasticRoundingState(NamedTuple):
    """State of `stochastic_rounding`.

    Attributes:
      key: the PRNG key of the next step (raw ``uint32`` key data); split once per applied step,
        kept on a step `loss_scaled` skips, so a run is reproducible from its seed.
      inner_state: the wrapped optimizer's state.

    Examples:
      >>> tx = jaxamp.optim_precision.stochastic_rounding(optax.adamw(1e-3), seed=0)
      >>> state = tx.init({"w": jnp.ones(4, jnp.bfloat16)})
      >>> state.key.dtype, state.key.shape
      (dtype('uint32'), (2,))
    """

    key: jax.Array
    inner_state: optax.OptState


class KahanSummationState(NamedTuple):
    """State of `kahan_summation`.

    Attributes:
      compensation: per parameter, what rounding left out of the parameters so far (the
        parameter's dtype by default, as optimi keeps it); added to the next update.
      inner_state: the wrapped optimizer's state.

    Examples:
      >>> tx = jaxamp.optim_precision.kahan_summation(optax.adamw(1e-3))
      >>> state = tx.init({"w": jnp.ones(4, jnp.bfloat16)})
      >>> state.compensation["w"].dtype
      dtype(bfloat16)
    """

    compensation: Any
    inner_state: optax.OptState


def _raw_key(seed: Any) -> jax.Array:
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"stochastic_rounding(seed={seed!r}): must be an int or a PRNG key.")
    if isinstance(seed, (int, np.integer)):
        return jax.random.key_data(jax.random.key(int(seed)))
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(seed)
    if isinstance(seed, (jax.Array, np.ndarray)) and seed.dtype == np.uint32:
        return jnp.asarray(seed)
    raise TypeError(
        f"stochastic_rounding(seed={seed!r}): must be an int or a PRNG key "
        "(jax.random.key(0) or jax.random.PRNGKey(0))."
    )


def _needs_params(caller: str, params: Any) -> None:
    if params is None:
        raise ValueError(
            f"{caller}.update(params=None): it rounds the new parameters, so it needs them: "
            "call update(grads, state, params)."
        )


def _narrow(p: Any) -> bool:
    return _is_float_array(p) and jnp.dtype(p.dtype).itemsize < 4


def _inner_step(inner, updates, inner_state, params, extra_args):
    """`inner` run in float32 (gradients, parameters and floating state upcast; codes kept),
    its state stored back in its own dtypes."""
    new_updates, new_inner = inner.update(
        to_compute(updates),
        to_compute(inner_state, decode=False),
        to_compute(params),
        **extra_args,
    )
    return new_updates, like_stored(new_inner, inner_state)


def stochastic_rounding(
    inner: optax.GradientTransformation, seed: Any = 0
) -> optax.GradientTransformationExtraArgs:
    """Rounds each new bfloat16/float16 parameter stochastically instead of to nearest.

    With bf16 parameters and no float32 masters, round to nearest drops every update smaller
    than half a bf16 step of its weight (2**-9 relative): small learning rates and weight decay
    stop working. Rounding ``p + update`` (computed in float32) stochastically keeps the
    expected parameter exact (torchao's ``_AdamW(bf16_stochastic_round=True)``). The returned
    updates are ``new_p - p`` in the parameter's dtype, so ``optax.apply_updates`` (and
    `jaxamp.apply_gradients`) land exactly on the rounded value whenever the step changes a
    weight by less than a factor of 2 (Sterbenz; a larger step lands within one ulp).
    float32 parameters get `inner`'s updates as they are.

    Compose it inside `jaxamp.loss_scaled` (a skipped step keeps the key and the inner state)
    and around `low_precision_state` for narrow state too.

    Args:
      inner: the optax optimizer; it runs in float32 on float32 gradients and parameters, its
        floating state stored back in its own dtypes.
      seed: an int or a PRNG key; the key lives in the state (reproducible runs, checkpoints).

    Returns:
      A `GradientTransformationExtraArgs` whose state is a `StochasticRoundingState`; `update`
      needs `params`.

    Examples:
      >>> params = {"w": jnp.full(4096, 1.0, jnp.bfloat16)}
      >>> tx = jaxamp.optim_precision.stochastic_rounding(optax.sgd(2.0**-12), seed=0)  # 1/32 of a bf16 step
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.full(4096, -1.0, jnp.bfloat16)}
      >>> @jax.jit
      ... def step(params, state):
      ...     updates, state = tx.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), state
      >>> for _ in range(32):
      ...     params, state = step(params, state)
      >>> round(float(params["w"].astype(jnp.float32).mean()), 2)  # 1 + 32 * 2**-12
      1.01
      >>> nearest = optax.apply_updates(
      ...     {"w": jnp.ones(2, jnp.bfloat16)}, {"w": jnp.full(2, 2.0**-12, jnp.bfloat16)})
      >>> nearest["w"]  # round to nearest never moves
      Array([1, 1], dtype=bfloat16)

    References:
      Gupta et al., Deep Learning with Limited Numerical Precision (2015); Zamirai et al.,
      Revisiting BFloat16 Training (2020); torchao ``torchao/optim/quant_utils.py``.
    """
    _check_inner("stochastic_rounding", inner)
    initial_key = _raw_key(seed)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        # A copy per call: a step that donates this state deletes its key's buffer.
        return StochasticRoundingState(fresh_buffers(initial_key), inner.init(params))

    def update(updates, state, params=None, **extra_args):
        _needs_params("stochastic_rounding", params)
        new_updates, inner_state = _inner_step(
            inner, updates, state.inner_state, params, extra_args
        )
        key, step_key = jax.random.split(state.key)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        step_updates = treedef.flatten_up_to(new_updates)
        keys = jax.random.split(step_key, max(len(leaves), 1))
        out = []
        for p, u, leaf_key in zip(leaves, step_updates, keys, strict=False):
            if not _narrow(p):
                out.append(u.astype(p.dtype) if _is_float_array(p) else u)
                continue
            p32 = p.astype(jnp.float32)
            new_p = stochastic_round(p32 + u.astype(jnp.float32), leaf_key, p.dtype)
            out.append((new_p.astype(jnp.float32) - p32).astype(p.dtype))
        return treedef.unflatten(out), StochasticRoundingState(key, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def kahan_summation(
    inner: optax.GradientTransformation, compensation_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    """Adds each step's rounding error of the parameters back into the next update (Kahan).

    The alternative to `stochastic_rounding`: deterministic, at the cost of one compensation
    buffer per parameter (bf16 by default, as optimi's ``kahan_sum``). Each step computes
    ``y = update + compensation`` in float32, rounds ``p + y`` to nearest, and keeps what the
    parameter did not take, ``y - (new_p - p)``. The returned updates are ``new_p - p`` in the
    parameter's dtype and the compensation is computed from what ``p + update`` gives in that
    dtype, so it accounts for exactly what `optax.apply_updates` stores. Works for float32
    parameters too (compensated float32 summation).

    Args:
      inner: the optax optimizer; it runs in float32 on float32 gradients and parameters.
      compensation_dtype: dtype of the compensation buffers; None (default): each parameter's.

    Returns:
      A `GradientTransformationExtraArgs` whose state is a `KahanSummationState`; `update`
      needs `params`.

    Examples:
      >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
      >>> tx = jaxamp.optim_precision.kahan_summation(optax.sgd(2.0**-12))
      >>> state = tx.init(params)
      >>> for _ in range(32):
      ...     updates, state = tx.update({"w": -jnp.ones(2, jnp.bfloat16)}, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"]  # 1 + 32 * 2**-12 = 1.0078125, one bf16 step
      Array([1.00781, 1.00781], dtype=bfloat16)

    References:
      Kahan, Further remarks on reducing truncation errors (1965); Zamirai et al., Revisiting
      BFloat16 Training (2020); optimi (``optimi.kahan_sum``).
    """
    _check_inner("kahan_summation", inner)
    if compensation_dtype is not None:
        try:
            dtype = np.dtype(compensation_dtype)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"kahan_summation(compensation_dtype={compensation_dtype!r}): must be None (the "
                "parameter's dtype) or a floating dtype: bfloat16, float16 or float32."
            )
        compensation_dtype = dtype
    inner = optax.with_extra_args_support(inner)

    def init(params):
        compensation = jax.tree_util.tree_map(
            # Non-float leaves get a placeholder: the tree keeps the parameters' structure.
            lambda p: (
                jnp.zeros(p.shape, compensation_dtype or p.dtype)
                if _is_float_array(p)
                else jnp.zeros((), jnp.float32)
            ),
            params,
        )
        return KahanSummationState(compensation, inner.init(params))

    def update(updates, state, params=None, **extra_args):
        _needs_params("kahan_summation", params)
        new_updates, inner_state = _inner_step(
            inner, updates, state.inner_state, params, extra_args
        )

        def compensate(p, u, c):
            if not _is_float_array(p):
                return u, c
            p32 = p.astype(jnp.float32) if _narrow(p) else p
            wide = p32.dtype
            # Narrow values read back through `widen`: XLA:GPU would otherwise delete the
            # float32 -> narrow -> float32 round trips (its excess precision) and the
            # compensation would miss the rounding it exists to keep.
            up = (lambda a: widen(a, wide)) if _narrow(p) else (lambda a: a)  # noqa: E731
            y = u.astype(wide) + c.astype(wide)
            new_p = (p32 + y).astype(p.dtype)
            delta = (up(new_p) - p32).astype(p.dtype)
            # What apply_updates stores: p + delta in the parameter's dtype.
            applied = (p + delta).astype(p.dtype)
            return delta, (y - (up(applied) - p32)).astype(c.dtype)

        leaves, treedef = jax.tree_util.tree_flatten(params)
        pairs = [
            compensate(p, u, c)
            for p, u, c in zip(
                leaves,
                treedef.flatten_up_to(new_updates),
                treedef.flatten_up_to(state.compensation),
                strict=True,
            )
        ]
        out = treedef.unflatten([d for d, _ in pairs])
        compensation = treedef.unflatten([c for _, c in pairs])
        return out, KahanSummationState(compensation, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def _check_inner(caller: str, inner: Any) -> None:
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"{caller}(inner=...) takes an optax GradientTransformation (e.g. "
            f"optax.adamw(1e-3)); got {type(inner).__name__} {inner!r}."
        )
    if isinstance(inner, LossScaledTransformation):
        raise ValueError(
            f"{caller}(inner=loss_scaled(...)): put loss_scaled outside, "
            f"loss_scaled({caller}(...)), so a skipped step keeps this wrapper's state too."
        )


# Precision presets that need the optimizer's cooperation: a policy and a wrapping of the
# optimizer. torchao calls the first `bf16_stochastic_round`, optimi the second `kahan_sum`;
# the names extend Lightning's "bf16-true".
PRESETS = {
    "bf16-true-sr": ("bf16-true", "stochastic_rounding"),
    "bf16-true-kahan": ("bf16-true", "kahan_summation"),
}


def preset(
    name: str, inner: optax.GradientTransformation, *, seed: Any = 0
) -> tuple[Policy, optax.GradientTransformationExtraArgs]:
    """The policy and the wrapped optimizer of a bf16-true preset whose weights still learn.

    A `Policy` holds dtypes only (jmp's grammar); how the parameters are rounded is the
    optimizer's part. A precision recipe (the harness's, or a training script's) decodes the name
    once here and gets both.

    Args:
      name: ``"bf16-true-sr"`` (bf16 everywhere, `stochastic_rounding`: torchao's
        ``_AdamW(bf16_stochastic_round=True)``) or ``"bf16-true-kahan"`` (`kahan_summation`:
        optimi's ``kahan_sum=True``).
      inner: the optax optimizer to wrap.
      seed: the stochastic rounding seed (int or PRNG key); ignored by Kahan.

    Returns:
      ``(policy, tx)``: ``jaxamp.get_policy("bf16-true")`` and the wrapped optimizer.

    Examples:
      >>> policy, tx = jaxamp.optim_precision.preset("bf16-true-sr", optax.adamw(1e-4))
      >>> str(policy), type(tx.init({"w": jnp.ones(2, jnp.bfloat16)})).__name__
      ('p=bf16,c=bf16,o=bf16', 'StochasticRoundingState')
      >>> jaxamp.optim_precision.preset("bf16-sr", optax.adamw(1e-4))
      Traceback (most recent call last):
      ...
      ValueError: preset(name='bf16-sr'): unknown preset; did you mean 'bf16-true-sr'? ...
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        raise ValueError(
            f"preset(name={name!r}): unknown preset{hint} Presets: {', '.join(PRESETS)} (plain "
            "dtype presets such as 'bf16-true' are jaxamp.get_policy's)."
        )
    policy_name, wrapper = PRESETS[name]
    if wrapper == "stochastic_rounding":
        tx = stochastic_rounding(inner, seed)
    else:
        tx = kahan_summation(inner)
    return get_policy(policy_name), tx
