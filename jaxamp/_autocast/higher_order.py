"""Higher-order primitives: autocast inside jit, remat, scan, while, cond, custom_jvp/vjp, shard_map.

Each rule re-runs the primitive's body through the interpreter (duck-typed: ``eval_jaxpr``,
``eval_closed``, ``_call_region``) and rebuilds the primitive with JAX's public API, keeping loop
carries and branch outputs in their traced dtypes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core
from jax.extend import linear_util as lu

from jaxamp._autocast.dtypes import aval_dtype, cast, dtype_of, is_castable
from jaxamp._autocast.rules import Region

# jax >= 0.11 (the release with custom_vjp.defvjp_with_logs): the bwd a custom_vjp_call binds
# returns (cotangents, logs); before, the cotangents alone.
_BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")
_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
Interpreter = Any  # jaxamp._autocast.interpreter.Interpreter (imported there, not here)


def _orig_dtypes(atoms: Sequence[Any]) -> list[np.dtype | None]:
    return [aval_dtype(a) for a in atoms]


def _cast_to(vals: Sequence[Any], dtypes: Sequence[np.dtype | None]) -> list:
    return [x if d is None else cast(x, d) for x, d in zip(vals, dtypes, strict=False)]


def _call(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    sub = interp._call_region(eqn, getattr(closed, "jaxpr", closed), region)
    if isinstance(closed, jex_core.ClosedJaxpr):
        outs = interp.eval_closed(closed, vals, sub)
    else:
        outs = interp.eval_jaxpr(closed, (), vals, sub)
    if sub is not None and sub.cast_outputs_like_input and sub is not region:
        first = next((dtype_of(x) for x in vals if is_castable(x)), None)
        if first is not None:
            outs = [cast(x, first) for x in outs]
    return outs


def _open(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    """A body's jaxpr and its constants (jax >= 0.11: every jaxpr carries its own)."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def _remat(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    p = eqn.params

    jaxpr, consts = _open(p["jaxpr"])

    def body(*args):
        return interp.eval_jaxpr(jaxpr, consts, args, region)

    return jax.checkpoint(body, policy=p["policy"], prevent_cse=p["prevent_cse"])(*vals)


def _scan_counts(params: dict) -> tuple[int, int]:
    """How many of a scan's operands are constants and carries."""
    if "num_consts" in params:  # jax <= 0.10: the counts are params
        return params["num_consts"], params["num_carry"]
    # jax >= 0.11: ``ft_in`` packs the operands as (constants, carries, scanned inputs)
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _scan(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    p = eqn.params
    nc, ncarry = _scan_counts(p)
    consts, init, xs = vals[:nc], vals[nc : nc + ncarry], vals[nc + ncarry :]
    # Carries keep their traced dtypes: a loop's state cannot change type between iterations.
    carry_dtypes = _orig_dtypes(eqn.invars[nc : nc + ncarry])

    def body(carry, x):
        outs = interp.eval_closed(p["jaxpr"], [*consts, *carry, *x], region)
        return _cast_to(outs[:ncarry], carry_dtypes), outs[ncarry:]

    kwargs = {}
    if p.get("_split_transpose"):
        kwargs["_split_transpose"] = True
    carry, ys = lax.scan(
        body,
        _cast_to(init, carry_dtypes),
        xs,
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
        **kwargs,
    )
    return [*carry, *ys]


def _while(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
    carry_dtypes = _orig_dtypes(eqn.invars[cn + bn :])

    def cond(carry):
        return interp.eval_closed(p["cond_jaxpr"], [*cconsts, *carry], region)[0]

    def body(carry):
        return _cast_to(
            interp.eval_closed(p["body_jaxpr"], [*bconsts, *carry], region), carry_dtypes
        )

    return list(lax.while_loop(cond, body, _cast_to(init, carry_dtypes)))


def _cond(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    index, ops = vals[0], vals[1:]
    # Branches must agree on output types: they return the dtypes the traced program had.
    out_dtypes = _orig_dtypes(eqn.outvars)

    def branch(closed):
        return lambda *args: _cast_to(interp.eval_closed(closed, args, region), out_dtypes)

    return list(lax.switch(index, [branch(b) for b in eqn.params["branches"]], *ops))


def _out_dtypes_of(fn: Callable, args: Sequence[Any]) -> list:
    shapes = jax.eval_shape(fn, *args)
    return [dtype_of(s) for s in shapes]


def _custom_jvp(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    params = dict(eqn.params)
    call = params.pop("call_jaxpr")
    nconsts = params.pop("num_consts")
    jvp_fun = params.pop("jvp_jaxpr_fun")
    debug = call.jaxpr.debug_info

    def primal(*args):
        return interp.eval_closed(call, args, region)

    out_dtypes = _out_dtypes_of(primal, vals)

    def jvp(*xs):
        n = len(xs) // 2
        primals, tangents = xs[nconsts:n], xs[n + nconsts :]
        zeros = [type(t) is SymbolicZero for t in tangents]
        jvp_jaxpr, jvp_consts, out_zeros = jvp_fun.call_wrapped(*zeros)
        nz = [t for t, z in zip(tangents, zeros, strict=False) if not z]
        # The user's rule runs under the same autocast rules as the primal.
        out = interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [*primals, *nz], region)
        out_primals = _cast_to(out[: len(out_zeros)], out_dtypes)
        nz_out = iter(out[len(out_zeros) :])
        out_tangents = []
        for p_out, z in zip(out_primals, out_zeros, strict=False):
            if z:
                aval = jax.typeof(p_out).to_tangent_aval()
                out_tangents.append(SymbolicZero(aval))
            else:
                t = next(nz_out)
                out_tangents.append(cast(t, dtype_of(p_out)) if is_castable(p_out) else t)
        return [*out_primals, *out_tangents]

    params["subfuns"] = (
        lu.wrap_init(primal, debug_info=debug),
        lu.wrap_init(jvp, debug_info=jvp_fun.debug_info),
    )
    return list(eqn.primitive.bind(*vals, **params))


def _custom_vjp(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    _, _, bwd = bind_params.pop("subfuns")
    call = eqn.params["call_jaxpr"]
    nconsts = eqn.params["num_consts"]
    fwd_thunk = eqn.params["fwd_jaxpr_thunk"]
    in_dtypes = [dtype_of(x) for x in vals]
    orig_out_dtypes = [dtype_of(a) for a in call.out_avals]

    def primal(*args):
        return interp.eval_closed(call, args, region)

    out_dtypes = _out_dtypes_of(primal, vals)
    n_out = len(out_dtypes)

    def fwd(*args):
        xs, nonzeros = args[::2], args[1::2]
        primals = xs[nconsts:]
        fwd_jaxpr, fwd_consts = fwd_thunk.call_wrapped(*nonzeros[nconsts:])
        outs = interp.eval_jaxpr(fwd_jaxpr, fwd_consts, primals, region)
        res, outs = outs[: len(outs) - n_out], outs[len(outs) - n_out :]
        return [*res, *_cast_to(outs, out_dtypes)]

    def bwd_cast(*args):
        res, cts = args[: len(args) - n_out], args[len(args) - n_out :]
        # The user's bwd sees cotangents in the dtypes it was written for.
        cts = [
            cast(c, d) if isinstance(c, jax.Array | jax.core.Tracer) else c
            for c, d in zip(cts, orig_out_dtypes, strict=False)
        ]
        out = bwd.call_wrapped(*res, *cts)
        cts_in, logs = out if _BWD_RETURNS_LOGS else (out, None)
        cts_in = [
            cast(c, d) if d is not None and isinstance(c, jax.Array | jax.core.Tracer) else c
            for c, d in zip(cts_in, in_dtypes, strict=False)
        ]
        return (cts_in, logs) if _BWD_RETURNS_LOGS else cts_in

    bind_params["subfuns"] = (
        lu.wrap_init(primal, debug_info=call.jaxpr.debug_info),
        lu.wrap_init(fwd, debug_info=fwd_thunk.debug_info),
        lu.wrap_init(bwd_cast, debug_info=bwd.debug_info),
    )
    return list(eqn.primitive.bind(*vals, **bind_params))


def _shard_map(interp: Interpreter, eqn: Any, vals: list, region: Region | None) -> list:
    p = eqn.params

    jaxpr, consts = _open(p["jaxpr"])

    def body(*args):
        return tuple(interp.eval_jaxpr(jaxpr, consts, args, region))

    fn = jax.shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(p.get("newly_manual_axes", frozenset())) or frozenset(),
        check_vma=p["check_vma"],
    )
    return list(fn(*vals))


HIGHER_ORDER: dict[str, Callable[..., list]] = {
    **{name: _call for name in _CALL_PRIMITIVES},
    "remat2": _remat,
    "checkpoint": _remat,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}
