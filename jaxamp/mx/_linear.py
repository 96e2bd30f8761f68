"""The block-scaled linear layer: a custom-VJP ``dot_general`` whose three matmuls take the recipe's
formats (torchao's ``mx_mm``), emulated or on block-scaled matmul hardware."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp.fp8._convert import register_format
from jaxamp.fp8._dot import linear_like, to_2d
from jaxamp.mx._formats import Format
from jaxamp.mx._quantize import from_block_scaled, to_block_scaled
from jaxamp.mx._recipes import Recipe
from jaxamp.mx._recipes import get_recipe as _make_recipe

__all__ = ["check_hardware", "dot_general", "mx_matmul_hardware"]


def mx_matmul_hardware() -> str | None:
    """None if the default backend has block-scaled (MX) matmul units (NVIDIA sm100+), else why not.

    Examples:
      >>> import jaxamp.mx
      >>> jaxamp.mx.mx_matmul_hardware()  # on a CPU  # doctest: +SKIP
      "the 'cpu' backend has no block-scaled matmul units"
    """
    backend = jax.default_backend()
    if backend == "gpu":
        device = jax.devices()[0]
        cc = getattr(device, "compute_capability", None)
        try:
            major = int(str(cc).split(".")[0])
        except ValueError:
            return f"GPU {device.device_kind} reports no CUDA compute capability ({cc!r})"
        if major >= 10:
            return None
        return f"GPU {device.device_kind} is sm{cc}; block-scaled matmuls need sm100 or newer"
    return f"the {backend!r} backend has no block-scaled matmul units"


def _hardware_format(fmt: Format) -> bool:
    # jax.nn.scaled_matmul's MXFP8 path: e4m3 elements, e8m0 scales, blocks of 32
    return fmt.element == "e4m3" and fmt.scale == "e8m0" and fmt.block_size == 32


def check_hardware(rec: Recipe) -> None:
    """Raise unless `rec` can run here: ``emulate=True``, or sm100+ hardware and MXFP8 operands.
    Never falls back to emulation.

    Examples:
      >>> import jaxamp.mx
      >>> jaxamp.mx.check_hardware(jaxamp.mx.get_recipe("mxfp8", emulate=True))  # any backend
    """
    if rec.emulate:
        return
    why = mx_matmul_hardware()
    if why is None:
        bad = [n for n, (f, _) in rec.operands().items() if not _hardware_format(f)]
        if rec.grad_weight_hp:
            bad = [
                n for n in bad if n not in ("input_for_grad_weight", "grad_output_for_grad_weight")
            ]
        if not bad:
            return
        why = f"jax.nn.scaled_matmul runs MXFP8 (e4m3, e8m0 scales, blocks of 32) and {bad} are not"
    raise ValueError(
        f"jaxamp.mx: recipe {rec.name!r} asks for block-scaled matmuls, but {why}. Pass "
        f"emulate=True (jaxamp.mx.get_recipe({rec.name!r}, emulate=True): quantized operands, "
        "dequantized, float32 matmul, as torchao's KernelPreference.EMULATED) or run on an "
        "sm100+ GPU."
    )


# The tensor each operand is taken from, as its axes are named: x (M, K), w (K, N), g (M, N).
_TENSOR_AXES = {
    "input": "MK",
    "weight": "KN",
    "grad_output": "MN",
    "weight_for_grad_input": "KN",
    "input_for_grad_weight": "MK",
    "grad_output_for_grad_weight": "MN",
}
# The axis each matmul contracts: blocks along it are what block-scaled hardware multiplies.
_CONTRACTED = {
    "input": "K",
    "weight": "K",
    "grad_output": "N",
    "weight_for_grad_input": "N",
    "input_for_grad_weight": "M",
    "grad_output_for_grad_weight": "M",
}


def operand_axis(rec: Recipe, role: str) -> tuple[Format, int]:
    """``(format, axis)`` of operand `role` in its tensor's layout (x (M, K), w (K, N), g (M, N)),
    read from the recipe's `Recipe.operands` (the block axis is data, as the format is)."""
    fmt, letter = rec.operands()[role]
    dims = _TENSOR_AXES[role]
    if letter not in dims:
        raise ValueError(
            f"jaxamp.mx: recipe {rec.name!r} blocks {role} along {letter!r}, which is not an "
            f"axis of its tensor ({dims[0]}, {dims[1]})."
        )
    return fmt, dims.index(letter)


def _emulated(t: jax.Array, rec: Recipe, role: str) -> jax.Array:
    """`t` quantized as operand `role`, dequantized to its own dtype (torchao EMULATED)."""
    fmt, axis = operand_axis(rec, role)
    q, s = to_block_scaled(t, fmt, axis)
    return from_block_scaled(q, s, fmt, axis, t.dtype)


def _hardware(t: jax.Array, rec: Recipe, role: str) -> tuple[jax.Array, jax.Array]:
    """`t` as ``jax.nn.scaled_matmul`` takes it: contraction last, codes and e8m0 scales."""
    fmt, axis = operand_axis(rec, role)
    if _TENSOR_AXES[role][axis] != _CONTRACTED[role]:
        raise ValueError(
            f"jaxamp.mx: block-scaled hardware contracts {role} along "
            f"{_CONTRACTED[role]}; recipe {rec.name!r} blocks it along "
            f"{_TENSOR_AXES[role][axis]} (emulate=True runs any axis)."
        )
    t = jnp.moveaxis(t, axis, -1)
    q, sc = to_block_scaled(t, fmt, -1)
    return q[None], lax.bitcast_convert_type(sc, jnp.float8_e8m0fnu)[None]


def _matmul(a, a_role, b, b_role, rec, dims, out_dtype):
    """``lax.dot_general(a, b, dims)`` on the two operands quantized as their roles say."""
    if rec.emulate:
        out = lax.dot_general(
            _emulated(a, rec, a_role),
            _emulated(b, rec, b_role),
            (dims, ((), ())),
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return out.astype(out_dtype)
    # each operand with its contracted (blocked) axis last: a (P, C), b (Q, C) -> (P, Q)
    (qa, sa), (qb, sb) = _hardware(a, rec, a_role), _hardware(b, rec, b_role)
    out = jax.nn.scaled_matmul(qa, qb, sa, sb, preferred_element_type=jnp.float32)[0]
    return out.astype(out_dtype)


def _check_shapes(m: int, k: int, n: int, rec: Recipe) -> None:
    sizes = {"M": m, "K": k, "N": n}
    what = {"M": "M (rows of the input)", "K": "K (input features)", "N": "N (output features)"}
    for role, (fmt, letter) in rec.operands().items():
        if rec.grad_weight_hp and role.endswith("for_grad_weight"):
            continue
        if sizes.get(letter, 0) % fmt.block_size:
            raise ValueError(
                f"jaxamp.mx: recipe {rec.name!r}: {what[letter]} is {sizes[letter]}, not a "
                f"multiple of the {fmt.block_size}-element blocks of {role} (x ({m}, {k}) @ w "
                f"({k}, {n})). torchao pads nothing either; pad the batch or exclude the layer."
            )


_XW = ((1,), (0,))  # x (M, K) @ w (K, N)
_GW_T = ((1,), (1,))  # g (M, N) @ w (K, N).T
_XT_G = ((0,), (0,))  # x (M, K).T @ g (M, N)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _linear(x: jax.Array, w: jax.Array, rec: Recipe, out_dtype: Any) -> jax.Array:
    """``x (M, K) @ w (K, N)`` with the recipe's formats (torchao's ``mx_mm.forward``)."""
    return _matmul(x, "input", w, "weight", rec, _XW, out_dtype)


def _linear_fwd(x, w, rec, out_dtype):
    return _linear(x, w, rec, out_dtype), (x, w)


def _linear_bwd(rec, out_dtype, res, g):
    del out_dtype
    x, w = res
    grad_x = _matmul(g, "grad_output", w, "weight_for_grad_input", rec, _GW_T, x.dtype)
    if rec.grad_weight_hp:
        grad_w = jnp.matmul(x.T, g, precision=lax.Precision.HIGHEST).astype(w.dtype)
    else:
        grad_w = _matmul(
            x, "input_for_grad_weight", g, "grad_output_for_grad_weight", rec, _XT_G, w.dtype
        )
    return grad_x.astype(x.dtype), grad_w.astype(w.dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    recipe: Recipe | str = "mxfp8",
    out_sharding: Any = None,
) -> jax.Array:
    """``lax.dot_general`` with block-scaled operands per `recipe`, backward pass included.

    `lhs` plays torchao's ``input`` and `rhs` the ``weight``; any contraction without batch
    dimensions works (operands are brought to ``x (M, K) @ w (K, N)``). Also usable as Flax's
    ``dot_general=`` argument.

    Args:
      lhs, rhs, dimension_numbers: as `jax.lax.dot_general`.
      precision: ignored (the recipe sets each matmul's); kept for the signature.
      preferred_element_type: output dtype (default: the promoted operand dtype).
      recipe: a `Recipe` or a recipe name.
      out_sharding: as `jax.lax.dot_general`'s.

    Raises:
      ValueError: batch dimensions, non-float operands, M, K or N not a multiple of the block
        size, or hardware without block-scaled matmuls and ``emulate=False``.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxamp.mx
      >>> r = jaxamp.mx.get_recipe("mxfp8", emulate=True)
      >>> @jax.jit
      ... def matmul(x, w):
      ...     return jaxamp.mx.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=r)
      >>> matmul(jnp.ones((32, 64)), jnp.ones((64, 32))).shape
      (32, 32)
    """
    del precision
    rec = _make_recipe(recipe)
    check_hardware(rec)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize < 2:
            raise ValueError(
                f"jaxamp.mx.dot_general: `{name}` must be a high-precision float array; got {x.dtype}."
            )
    why = linear_like(dimension_numbers, lhs.ndim, rhs.ndim)
    if why:
        raise ValueError(f"jaxamp.mx.dot_general: cannot run this dot block-scaled: {why}.")
    x2, w2, out_shape = to_2d(lhs, rhs, dimension_numbers)
    _check_shapes(x2.shape[0], x2.shape[1], w2.shape[1], rec)
    out_dtype = np.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    y = _linear(x2, w2, rec, out_dtype).reshape(out_shape)
    if out_sharding is not None:
        y = jax.lax.with_sharding_constraint(y, out_sharding)
    return y


# jaxamp.fp8's matmul rewrite (convert, report, capture_operands, autocast's fp8= hook) runs a
# block-scaled recipe with these two.
register_format(Recipe, dot_general, check_hardware)
