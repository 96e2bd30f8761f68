"""Gradient reductions in a policy's ``reduce_dtype`` (FSDP2's meaning), under SPMD partitioning.

Why this exists: with float32 parameters cast to bfloat16 for compute, the weight gradient of a
bfloat16 ``dot_general`` is a bfloat16 dot. When the batch is sharded, XLA's SPMD partitioner
computes that dot per device and sums the partial results with an all-reduce *in bfloat16*;
only afterwards does the cast's transpose turn the gradient into float32. torch DDP and FSDP2
(``MixedPrecisionPolicy(reduce_dtype=float32)``) sum float32 gradients instead. (XLA:CPU upcasts
bf16 all-reduces late in compilation, so only the post-partitioning HLO shows the difference.)

How: :func:`reduce_in` traces a function to a jaxpr and re-evaluates it. Floating inputs are
tracked through casts and element-moving ops (transpose, reshape, broadcast, slices, gathers). Where such a
value is *narrowed* (cast to a smaller float dtype) and then consumed by an op, the op runs as a
``custom_vjp``: the forward pass is exactly the original op on the narrowed operand; the backward
pass computes the wide input's cotangent with every ``dot_general``/``conv_general_dilated`` set
to ``preferred_element_type=reduce_dtype`` (bfloat16 operands, ``reduce_dtype`` accumulation and
result) and every other op (bias sums, scales, gather's scatter-add) in ``reduce_dtype``. The
partial sums the partitioner then all-reduces (or reduce-scatters, for sharded parameters) are
``reduce_dtype`` values. The result is then rounded to the compute dtype's precision and range
(as torch's low-precision kernels return it: a float16 weight gradient past 65504 is inf, so a
loss scaler skips the step as torch's does) and returned in the input's dtype. Under
``shard_map`` that rounding is per device, before the float32 ``psum``: torch DDP/FSDP2's order
exactly; under ``jit`` the partitioner sums the per-device partial products first (XLA cannot
round a partial sum), so the rounding applies to the float32 sum. Activation gradients keep the
compute dtype.

Under ``shard_map``, an invariant (replicated) value meeting per-device data goes through
``pvary``, whose transpose is a ``psum`` of the per-device cotangents; narrow inputs of ``pvary``
are carried in ``reduce_dtype`` there so that ``psum`` runs in ``reduce_dtype`` as well.

Limits: ops inside ``scan``/``while``/``cond``/``custom_jvp``/``custom_vjp``/``checkpoint``/
``shard_map`` bodies that consume a narrowed input keep JAX's default (their gradients are reduced
in the compute dtype); calls (``jit``) are inlined and handled. A ``reduce_dtype`` narrower than the
compute dtype is not applied (gradients are reduced in the compute dtype).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._numerics import over_array_leaves

__all__ = ["reduce_in", "needs_reduce_transform"]

# Ops that only move, pick or repeat elements: a cast commutes with them, so the wide value is
# carried through them (their transposes then run on wide cotangents).
_LAYOUT = frozenset(
    {
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "rev",
        "copy",
        "copy_p",
        # Row lookups (embeddings, positional tables): the cast commutes with them too.
        "gather",
        # shard_map's invariant -> per-device marker (its transpose is a psum).
        "pvary",
    }
)
# Calls whose body is inlined (XLA inlines them anyway).
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
# shard_map's "invariant value becomes per-device" op: its transpose is a psum.
_VARYING = frozenset({"pvary"})
# Ops that accumulate: their reduce-dtype form keeps the inputs and widens the accumulator.
_ACCUMULATING = frozenset({"dot_general", "conv_general_dilated"})


def _is_float(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        return False


def _dtype(x: Any) -> np.dtype | None:
    dtype = getattr(x, "dtype", None)
    return np.dtype(dtype) if dtype is not None and _is_float(dtype) else None


def _wider(a: np.dtype, b: np.dtype) -> np.dtype:
    return a if a.itemsize >= b.itemsize else b


def _sub_jaxprs(eqn: Any) -> bool:
    return any(
        isinstance(p, jex_core.ClosedJaxpr | jex_core.Jaxpr)
        or (
            isinstance(p, tuple | list)
            and p
            and isinstance(p[0], jex_core.ClosedJaxpr | jex_core.Jaxpr)
        )
        for p in eqn.params.values()
    )


def _bind(eqn: Any, vals: Sequence[Any], params: dict | None = None) -> list:
    # get_bind_params turns call-like params (custom_jvp/vjp rules, jaxprs) into bindable form.
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, jex_core.Literal) else env[v]


def _call_body(eqn: Any) -> tuple[Any, Sequence[Any]]:
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(closed, jex_core.ClosedJaxpr):
        return closed.jaxpr, closed.consts
    return closed, ()


# -- backward: a cotangent computation with reduce-dtype accumulation ------------------------------


def _eval_wide(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], reduce_dtype: np.dtype):
    """Evaluates a (linear) cotangent jaxpr, accumulating dots in `reduce_dtype` and never narrowing."""
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        vals = [_read(env, v) for v in eqn.invars]
        outs = _wide_eqn(eqn, vals, reduce_dtype)
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [_read(env, v) for v in jaxpr.outvars]


def _wide_eqn(eqn: Any, vals: list, reduce_dtype: np.dtype) -> list:
    name = eqn.primitive.name
    float_dtypes = [d for d in map(_dtype, vals) if d is not None]
    if name == "convert_element_type":
        new = np.dtype(eqn.params["new_dtype"])
        x = vals[0]
        if _dtype(x) is not None and _is_float(new):
            # Never narrow: the cotangent stays as wide as it has become.
            return [x if _dtype(x).itemsize >= new.itemsize else x.astype(new)]
        return _bind(eqn, vals)
    if name in _CALLS:
        body, consts = _call_body(eqn)
        return _eval_wide(body, consts, vals, reduce_dtype)
    if name in _ACCUMULATING:
        common = functools.reduce(_wider, float_dtypes)
        accumulate = _wider(common, reduce_dtype)
        if jax.default_backend() == "cpu":
            # XLA:CPU has no bf16 x bf16 -> f32 dot kernel for every shape. Upcasting the inputs
            # is the same arithmetic: products of two bf16 (or f16) values are exact in float32.
            common = accumulate
        vals = [x.astype(common) if _dtype(x) is not None else x for x in vals]
        params = dict(eqn.params, preferred_element_type=accumulate)
        return _bind(eqn, vals, params)
    if _sub_jaxprs(eqn) and "update_jaxpr" not in eqn.params:
        # Opaque higher-order op: evaluate it exactly as traced.
        return _bind(eqn, [_as_traced(x, v) for x, v in zip(vals, eqn.invars, strict=True)])
    if not float_dtypes:
        return _bind(eqn, vals)
    common = _wider(functools.reduce(_wider, float_dtypes), reduce_dtype)
    vals = [x.astype(common) if _dtype(x) not in (None, common) else x for x in vals]
    if name == "scatter-add" or name == "scatter_add":
        p = eqn.params
        return [
            lax.scatter_add(
                vals[0],
                vals[1],
                vals[2],
                p["dimension_numbers"],
                indices_are_sorted=p["indices_are_sorted"],
                unique_indices=p["unique_indices"],
                mode=p["mode"],
            )
        ]
    if "update_jaxpr" in eqn.params:
        return _bind(eqn, [_as_traced(x, v) for x, v in zip(vals, eqn.invars, strict=True)])
    return _bind(eqn, vals)


def _as_traced(x: Any, v: Any) -> Any:
    aval = getattr(v, "aval", None)
    dtype = getattr(aval, "dtype", None)
    if dtype is not None and _dtype(x) is not None and _is_float(dtype) and x.dtype != dtype:
        return x.astype(dtype)
    return x


# -- forward: find narrowed inputs, fuse their consumers with a reduce-dtype backward ---------------


def _round_to(x: Any, narrow: np.dtype) -> Any:
    """`x` rounded to `narrow`'s precision and range (overflow: inf), keeping its own dtype.

    torch's low-precision kernels return the gradient in the compute dtype (a float16 weight
    gradient above 65504 is inf, and GradScaler skips the step); this keeps that, while the
    arithmetic before it (and any cross-device sum the partitioner places there) stays wide.
    """
    xd = _dtype(x)
    if xd is None or narrow.itemsize >= xd.itemsize:
        return x
    info = jnp.finfo(narrow)
    return lax.reduce_precision(x, exponent_bits=int(info.nexp), mantissa_bits=int(info.nmant))


def _fused(eqn: Any, vals: list, wides: list, reduce_dtype: np.dtype) -> list:
    """Runs `eqn` on `vals`; wide operands' cotangents are computed in `reduce_dtype`."""
    wide_pos = [i for i, w in enumerate(wides) if w is not None]
    float_pos = [i for i, x in enumerate(vals) if _dtype(x) is not None]
    narrow_dtypes = [np.dtype(vals[i].dtype) for i in wide_pos]
    wide_dtypes = [np.dtype(wides[i].dtype) for i in wide_pos]
    multiple = eqn.primitive.multiple_results

    def narrowed(wide_vals, others):
        ops = list(others)
        for i, w, d in zip(wide_pos, wide_vals, narrow_dtypes, strict=True):
            ops[i] = w.astype(d)
        return ops

    def apply(ops):
        out = _bind(eqn, ops)
        return tuple(out) if multiple else out[0]

    @jax.custom_vjp
    def op(wide_vals, others):
        return apply(narrowed(wide_vals, others))

    def fwd(wide_vals, others):
        ops = narrowed(wide_vals, others)
        return apply(ops), tuple(ops)

    def bwd(res, ct):
        ops = list(res)

        def on_floats(*fl):
            full = list(ops)
            for i, x in zip(float_pos, fl, strict=True):
                full[i] = x
            return apply(full)

        _, vjp_fn = jax.vjp(on_floats, *[ops[i] for i in float_pos])
        narrow_cts = dict(zip(float_pos, vjp_fn(ct), strict=True))
        ct_leaves, ct_tree = jax.tree_util.tree_flatten(ct)
        closed = jax.make_jaxpr(lambda *c: vjp_fn(jax.tree_util.tree_unflatten(ct_tree, c)))(
            *ct_leaves
        )
        wide_cts_all = _eval_wide(closed.jaxpr, closed.consts, ct_leaves, reduce_dtype)
        wide_cts_all = dict(zip(float_pos, wide_cts_all, strict=True))
        wide_cts = tuple(
            _round_to(wide_cts_all[i], narrow).astype(d)
            for i, narrow, d in zip(wide_pos, narrow_dtypes, wide_dtypes, strict=True)
        )
        other_cts = tuple(
            None if i in wide_pos or i not in narrow_cts else narrow_cts[i] for i in range(len(ops))
        )
        return wide_cts, other_cts

    op.defvjp(fwd, bwd)
    others = list(vals)
    out = op(tuple(wides[i] for i in wide_pos), tuple(others))
    return list(out) if multiple else [out]


def _narrower(x: Any, dtype: np.dtype) -> bool:
    d = _dtype(x)
    return d is not None and d.itemsize < dtype.itemsize


def _pvary_wide(eqn: Any, vals: list, reduce_dtype: np.dtype) -> list:
    """``pvary`` (shard_map: an invariant value meets per-device data) in `reduce_dtype`.

    Its transpose is the ``psum`` that sums the per-device cotangents of an invariant value
    (e.g. a replicated parameter's lookup). Casting up before and back after leaves forward
    values unchanged (the round trip is exact) and makes that ``psum`` run in `reduce_dtype`.
    """
    wide = [x.astype(reduce_dtype) if _narrower(x, reduce_dtype) else x for x in vals]
    outs = _bind(eqn, wide)
    return [
        o.astype(x.dtype) if _narrower(x, reduce_dtype) else o
        for o, x in zip(outs, vals, strict=True)
    ]


def _eval_forward(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    wides: Sequence[Any],
    reduce_dtype: np.dtype,
) -> tuple[list, list]:
    env: dict[Any, Any] = {}
    wide: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x, w in zip(jaxpr.invars, args, wides, strict=True):
        env[v] = x
        if w is not None:
            wide[v] = w

    for eqn in jaxpr.eqns:
        vals = [_read(env, v) for v in eqn.invars]
        in_wide = [wide.get(v) if isinstance(v, jex_core.Var) else None for v in eqn.invars]
        out_wide: list = [None] * len(eqn.outvars)
        name = eqn.primitive.name
        wide_layout = name in _LAYOUT and any(w is not None for w in in_wide)
        if name in _VARYING and not wide_layout and any(_narrower(x, reduce_dtype) for x in vals):
            outs = _pvary_wide(eqn, vals, reduce_dtype)
            out_wide = [
                w if w is not None and _dtype(x) is not None and x.dtype == w.dtype else None
                for x, w in zip(outs, in_wide, strict=False)
            ]
        elif all(w is None for w in in_wide):
            outs = _bind(eqn, vals)
        elif name in _CALLS:
            body, body_consts = _call_body(eqn)
            outs, out_wide = _eval_forward(body, body_consts, vals, in_wide, reduce_dtype)
        elif name == "convert_element_type":
            outs = _bind(eqn, vals)
            new, w = _dtype(outs[0]), in_wide[0]
            if new is not None and new.itemsize <= w.dtype.itemsize:
                out_wide = [w]
        elif name in _LAYOUT:
            outs = _bind(eqn, vals)
            floats = [i for i, x in enumerate(vals) if _dtype(x) is not None]
            if len(floats) == 1 and in_wide[floats[0]] is not None:
                wide_vals = list(vals)
                wide_vals[floats[0]] = in_wide[floats[0]]
                out_wide = _bind(eqn, wide_vals)
        else:
            narrowed = [
                w if w is not None and _dtype(x) is not None and x.dtype != w.dtype else None
                for x, w in zip(vals, in_wide, strict=True)
            ]
            if all(w is None for w in narrowed) or _sub_jaxprs(eqn) and name != "scatter-add":
                outs = _bind(eqn, vals)
            else:
                outs = _fused(eqn, vals, narrowed, reduce_dtype)
        for v, x, w in zip(eqn.outvars, outs, out_wide, strict=True):
            env[v] = x
            if w is not None:
                wide[v] = w
    outs = [_read(env, v) for v in jaxpr.outvars]
    return outs, [wide.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars]


def needs_reduce_transform(compute_dtype: Any, reduce_dtype: Any) -> bool:
    """Whether gradients of a `compute_dtype` computation need the transform to reduce in `reduce_dtype`."""
    if reduce_dtype is None or compute_dtype is None:
        return False
    return np.dtype(reduce_dtype).itemsize > np.dtype(compute_dtype).itemsize


def reduce_in(fn: Callable, reduce_dtype: Any) -> Callable:
    """Returns `fn` whose inputs' gradients are accumulated and reduced in `reduce_dtype`.

    Forward values are unchanged (the same ops on the same dtypes). For every floating input
    that `fn` narrows (e.g. float32 params cast to bfloat16) before an op uses it, that input's
    cotangent is computed with `reduce_dtype` accumulation, so the cross-device sums the SPMD
    partitioner inserts for a sharded batch run in `reduce_dtype`. See the module docstring.

    Args:
      fn: any function of arrays (pytrees; non-array leaves are static).
      reduce_dtype: the floating dtype for gradient accumulation and reduction.

    Returns:
      A function with `fn`'s signature.

    Examples:
      >>> from jaxamp._reduce import reduce_in
      >>> def loss(w, x):
      ...     return jnp.sum(x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
      >>> w, x = jnp.ones((4, 2)), jnp.ones((8, 4))
      >>> g = jax.jit(jax.grad(reduce_in(loss, jnp.float32)))(w, x)  # w's gradient in f32
      >>> g.dtype, float(g[0, 0])
      (dtype('float32'), 8.0)
    """
    reduce_dtype = np.dtype(reduce_dtype)
    if not _is_float(reduce_dtype):
        raise ValueError(f"reduce_in: reduce_dtype must be a floating dtype; got {reduce_dtype}.")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        flat_fn, dyn_vals = over_array_leaves(fn, args, kwargs)
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
        wides = [x if _dtype(x) is not None else None for x in dyn_vals]
        outs, _ = _eval_forward(closed.jaxpr, closed.consts, dyn_vals, wides, reduce_dtype)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped
