"""Matmul and convolution FLOPs of a JAX program by operand dtype, without torch.

`jax_matmul_flops` counts what a jaxpr's ``dot_general`` / ``conv_general_dilated`` equations
compute, by dtype; `requested_fraction` says which fraction ran in the dtype a run asked for (the
step-0 compute-dtype verdict). The torch twin, `parity.training.dtype_trace.torch_matmul_flops`, needs
torch; this module does not (a golden check runs the JAX side where torch is not installed).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax.extend.core

__all__ = ["counted_equations", "jax_matmul_flops", "requested_fraction"]


_MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated")


def counted_equations(jaxpr: Any, times: int = 1) -> Iterator[tuple[Any, int]]:
    """Every equation of `jaxpr` and of the jaxprs inside it, with how many times one call runs
    it: a ``scan`` body ``length`` times, a ``while`` body once (its trip count is not static)."""
    for eqn in jaxpr.eqns:
        yield eqn, times
        inner = times * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else times
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from counted_equations(sub, inner)


def _jax_op_flops(eqn: Any) -> int:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        # 2 * (every output element) * (contraction length).
        (contract_lhs, _), _ = eqn.params["dimension_numbers"]
        contraction = 1
        for axis in contract_lhs:
            contraction *= int(lhs.shape[axis])
        return 2 * int(math.prod(out.shape)) * contraction
    # conv: 2 * (every output element) * (kernel window x input features per group).
    rhs_spec = eqn.params["dimension_numbers"].rhs_spec
    per_output = int(math.prod(rhs.shape)) // int(rhs.shape[rhs_spec[0]])
    return 2 * int(math.prod(out.shape)) * per_output


def jax_matmul_flops(closed_jaxpr: Any) -> dict[str, int]:
    """FLOPs of every ``dot_general`` / ``conv_general_dilated`` in a jaxpr, by operand dtype.

    Sub-jaxprs (``jit``, ``custom_jvp``/``custom_vjp`` calls, ``remat``, ``cond`` branches,
    ``while`` bodies) are entered; a ``scan`` body counts ``length`` times (a ``while`` body once:
    its trip count is not static). An op whose two operands differ in dtype is filed under
    ``"lhs/rhs"``.

    Args:
      closed_jaxpr: from ``jax.make_jaxpr(fn)(*args)``.

    Returns:
      ``{dtype name: FLOPs}`` (multiply-add = 2 FLOPs).

    Examples:
      >>> jax_matmul_flops(jax.make_jaxpr(jnp.matmul)(jnp.ones((2, 3)), jnp.ones((3, 4))))
      {'float32': 48}
    """
    totals: dict[str, int] = {}
    jaxpr = closed_jaxpr.jaxpr if hasattr(closed_jaxpr, "jaxpr") else closed_jaxpr
    for eqn, times in counted_equations(jaxpr):
        if eqn.primitive.name in _MATMUL_PRIMITIVES:
            dtypes = [str(v.aval.dtype) for v in eqn.invars[:2]]
            key = dtypes[0] if dtypes[0] == dtypes[1] else "/".join(dtypes)
            totals[key] = totals.get(key, 0) + times * _jax_op_flops(eqn)
    return totals


def requested_fraction(flops: dict[str, int], dtype: str) -> float | None:
    """The fraction of ``flops`` (from :func:`jax_matmul_flops` or ``parity.training.dtype_trace.torch_matmul_flops``)
    whose operands were all ``dtype``; None when there were no matmul FLOPs."""
    total = sum(flops.values())
    if total == 0:
        return None
    return flops.get(dtype, 0) / total
