"""`value_and_grad` with a policy and a loss scale: the one call a mixed-precision step needs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._autocast.api import transform
from jaxamp._loss_scale import NoOpLossScale
from jaxamp._loss_scaled_state import get_loss_scale
from jaxamp._numerics import scale_tree
from jaxamp._policy import Policy, check_param_dtypes, get_policy, parse_dtype
from jaxamp._reduce import needs_reduce_transform, reduce_in

__all__ = ["value_and_grad", "scaled_loss"]

_F16 = jnp.dtype(jnp.float16)
_FLOATS = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def scaled_loss(
    fun: Callable[..., Any], loss_scale: Any, *, has_aux: bool, caller: str
) -> Callable[..., Any]:
    """`fun` returning ``(loss * scale, (loss, aux))``, the loss as float32 and scaled in float32.

    The one scaled loss every gradient helper differentiates (`value_and_grad`, the Flax glue's
    `TrainState.value_and_grad` and `nnx_value_and_grad`). The loss is cast to float32 *before*
    it is multiplied: a float16 loss times 2**16 is inf in float16, not in float32.

    Args:
      fun: returns a scalar loss, or ``(loss, aux)`` with `has_aux`.
      loss_scale: a loss scale object (its `loss_scale` is read when the function runs).
      has_aux: whether `fun` returns ``(loss, aux)``.
      caller: named in the error for a loss that is not a scalar.
    """

    def scaled(*args, **kwargs):
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss)
        if loss.shape != ():
            raise TypeError(f"{caller}: fun must return a scalar loss; got shape {loss.shape}.")
        loss32 = loss.astype(jnp.float32)
        return scale_tree(loss32, jnp.asarray(loss_scale.loss_scale, jnp.float32)), (loss32, aux)

    return scaled


def value_and_grad(
    fun: Callable[..., Any],
    *,
    policy: Policy | str | None = None,
    has_aux: bool = False,
    argnums: int = 0,
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """Like `jax.value_and_grad`, for a mixed-precision step: casts, scales, differentiates.

    The returned function takes `fun`'s arguments plus a keyword `loss_scale` (a loss scale,
    an optimizer state of `jaxamp.loss_scaled` — its current scale is used — or None for no
    scaling). It:

    1. casts the floating leaves of every positional argument (params and inputs) to the
       policy's compute dtype (ints, bools and PRNG keys untouched);
    2. runs `fun` and casts its loss (and aux) to the policy's output dtype; where the
       compute dtype is float16, `fun` runs under torch.autocast's CUDA op lists
       (`jaxamp.autocast(device="cuda", dtype=float16)`): losses, softmax, sums, exp/log run in
       float32, as torch's float16 autocast runs them, so the loss is float32 before it is
       scaled and the default scale 2**16 (inf in float16) reaches the float16 part of the
       backward pass already divided by the loss's reductions. A loss that is
       still float16 at the end (a bare ``jnp.mean`` of float16 values, which torch also
       leaves in float16) overflows at scales above 65504: compute it in float32;
    3. scales the loss in float32 and differentiates that with respect to `args[argnums]`;
    4. where the policy's `reduce_dtype` is wider than its compute dtype (the mixed presets:
       float32), computes the weight gradients with `reduce_dtype` accumulation, so that with a
       sharded batch the cross-device gradient sums (all-reduce / reduce-scatter) that XLA's
       SPMD partitioner inserts run in `reduce_dtype`, as torch DDP/FSDP2 sum float32 gradients.
       Forward values are unchanged. Under `shard_map`/`pmap`, the gradients returned are in the
       param dtype; `psum` them (or `policy.cast_to_reduce(grads)`) to reduce in that dtype.

    Returns `(loss, grads)` — or `((loss, aux), grads)` with `has_aux` — where `loss` is the
    unscaled float32 loss and `grads` are gradients of the *scaled* loss, in the dtype of the
    parameters as passed (float32 params give float32 grads: the casts are differentiable).
    Hand `grads` to a `loss_scaled` optimizer, which unscales them.

    Args:
      fun: `fun(params, *inputs, **kwargs) -> loss` or `-> (loss, aux)`.
      policy: a `Policy` or anything `get_policy` accepts; None casts nothing. The
        differentiated argument's floating leaves must be in its param dtype or wider (float16
        master weights under "fp16-mixed" raise `TypeError`, as torch refuses to unscale
        float16 gradients).
      has_aux: whether `fun` returns `(loss, aux)`.
      argnums: which positional argument to differentiate (an int).
      reduce_dtype: the dtype gradients are accumulated and reduced across devices in; default
        the policy's `reduce_dtype` (applied where wider than its compute dtype). Give it when
        `fun` casts by itself (e.g. a `jaxamp.autocast` forward pass) to reduce in that dtype
        the gradients of every input `fun` narrows.

    Examples:
      >>> def loss_fn(params, x):
      ...     return jnp.mean((x @ params["w"]) ** 2)
      >>> params, x = {"w": jnp.full((3, 2), 0.1)}, jnp.ones((4, 3))
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> opt_state = tx.init(params)
      >>> grad_fn = jaxamp.value_and_grad(loss_fn, policy="fp16-mixed")
      >>> @jax.jit
      ... def train_step(params, opt_state, x):
      ...     loss, grads = grad_fn(params, x, loss_scale=opt_state)  # grads of the scaled loss
      ...     updates, opt_state = tx.update(grads, opt_state, params)
      ...     return jaxamp.apply_updates(params, updates, opt_state), opt_state, loss, grads
      >>> params, opt_state, loss, grads = train_step(params, opt_state, x)
      >>> loss.dtype, grads["w"].dtype
      (dtype('float32'), dtype('float32'))
    """
    if not callable(fun):
        raise TypeError(f"value_and_grad(fun=...) takes a callable; got {type(fun).__name__}.")
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"value_and_grad(argnums=...) takes an int; got {argnums!r}.")
    policy = None if policy is None else get_policy(policy)
    if reduce_dtype is not None:
        reduce_dtype = parse_dtype(reduce_dtype, where="value_and_grad(reduce_dtype=...)")
    elif policy is not None and needs_reduce_transform(policy.compute_dtype, policy.reduce_dtype):
        reduce_dtype = policy.reduce_dtype

    # Under float16 compute, torch's float16 autocast lists (losses and reductions in float32).
    forward = fun
    if policy is not None and policy.compute_dtype == _F16:
        forward = transform(fun, dtype=_F16, device="cuda")

    @functools.wraps(fun)
    def wrapped(*args, loss_scale: Any = None, **kwargs):
        if not -len(args) <= argnums < len(args):
            raise ValueError(
                f"value_and_grad: argnums={argnums} but the function got {len(args)} "
                "positional arguments."
            )
        scale = NoOpLossScale() if loss_scale is None else get_loss_scale(loss_scale)
        index = argnums % len(args)
        if policy is not None:
            # Narrower than the policy's param dtype (float16 master weights under
            # "fp16-mixed") is refused; wider params get wider gradients through the cast.
            allowed = {
                d
                for d in _FLOATS
                if d == policy.param_dtype or d.itemsize > policy.param_dtype.itemsize
            }
            check_param_dtypes(
                args[index], lambda _: allowed, policy, f"value_and_grad(argnums={argnums})"
            )
            # Inputs are cast here; the differentiated argument inside, so that the cast is
            # part of the gradient (float32 params get float32 gradients).
            args = tuple(a if i == index else policy.cast_to_compute(a) for i, a in enumerate(args))

        def loss_and_aux(diff_arg, *rest, **kw):
            if policy is not None:
                diff_arg = policy.cast_to_compute(diff_arg)
            full_args = list(rest)
            full_args.insert(index, diff_arg)
            out = forward(*full_args, **kw)
            if policy is not None:
                out = policy.cast_to_output(out)
            return out

        if reduce_dtype is not None:
            # Weight gradients accumulate, and are summed across devices, in reduce_dtype.
            loss_and_aux = reduce_in(loss_and_aux, reduce_dtype)
        scaled = scaled_loss(loss_and_aux, scale, has_aux=has_aux, caller="value_and_grad")

        def scaled_of_rest(diff_arg, *rest):
            return scaled(diff_arg, *rest, **kwargs)

        rest = args[:index] + args[index + 1 :]
        (_, (loss, aux)), grads = jax.value_and_grad(scaled_of_rest, has_aux=True)(
            args[index], *rest
        )
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped
