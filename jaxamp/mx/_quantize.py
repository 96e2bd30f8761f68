"""Block quantization and dequantization, bit-exact to torchao's ``to_mx`` / ``nvfp4_quantize``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._numerics import widen
from jaxamp.mx import _bits
from jaxamp.mx._formats import Format
from jaxamp.mx._formats import get_format as _make_format
from jaxamp.mx._scales import E8M0_BIAS, E8M0_NAN, e8m0_exponent, nvfp4_scales

__all__ = ["from_block_scaled", "per_tensor_scale", "scales_to_float32", "to_block_scaled"]

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check_input(x: Any, fmt: Format, axis: int, where: str) -> tuple[jax.Array, int]:
    x = jnp.asarray(x)
    if x.dtype not in [np.dtype(d) for d in _FLOATS]:
        raise ValueError(
            f"{where}: `x` must be float32, bfloat16 or float16 (torchao takes float32 and "
            f"bfloat16); got {x.dtype}."
        )
    if x.ndim == 0:
        raise ValueError(f"{where}: `x` must have at least one axis to block; got a scalar.")
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(f"{where}: `axis` must be an int; got {axis!r}.")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{where}: axis={axis} is out of range for shape {x.shape}.")
    axis = int(axis) % x.ndim
    if x.shape[axis] % fmt.block_size:
        raise ValueError(
            f"{where}: axis {axis} of shape {x.shape} has {x.shape[axis]} elements, not a "
            f"multiple of {fmt.name}'s block size {fmt.block_size} (torchao pads nothing either)."
        )
    return x, axis


def _blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """``(..., n_blocks, block)`` with the blocked axis moved last."""
    x = jnp.moveaxis(x, axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblocks(x: jax.Array, axis: int) -> jax.Array:
    x = x.reshape(*x.shape[:-2], -1)
    return jnp.moveaxis(x, -1, axis)


def _scaled_mx(data: jax.Array, biased: jax.Array, fmt: Format) -> jax.Array:
    """The elements divided by their block's e8m0 scale, as torchao computes it per mode
    (NaN blocks aside: `_nan_overrides`)."""
    b = biased.astype(jnp.int32)[..., None]
    if fmt.scale_mode == "rceil":
        # elements times the reciprocal 2**(127 - code); code 0 multiplies by 1 (torchao)
        return _bits.mul_pow2(data, jnp.where(b == 0, 0, E8M0_BIAS - b))
    # elements divided by the float32 scale, the scale at least 2**-126
    return _bits.mul_pow2(data, -(jnp.maximum(b, 1) - E8M0_BIAS))


# The float32 NaN torch computes where an element meets a NaN: x86's default NaN (inf / inf),
# torch's widening of the e4m3 NaN scale (NVFP4), a quiet NaN.
_DEFAULT_NAN = np.uint32(0xFFC00000)
_E4M3_NAN_F32 = np.uint32(0x7FF00000)
_QUIET = np.uint32(0x00400000)


def _nan_overrides(data: jax.Array, nan_block: jax.Array, mab: jax.Array, fmt: Format):
    """``(mask, codes)``: the elements whose scaled value torch makes NaN, and their codes.

    Decided from bits, not from how the compiler propagates NaNs: in a NaN block (torch's scale
    is NaN or inf there), FLOOR-family modes divide by inf (a NaN element stays itself, quieted;
    an infinite one becomes the default NaN; finite ones become signed zeros, computed normally),
    RCEIL multiplies every element by the NaN ``amax / max``, and NVFP4 by the NaN reciprocal of
    its e4m3 NaN scale: there every element becomes that NaN.
    """
    bits = _bits.f32_bits(data)
    if fmt.scale == "e4m3":
        nan_bits = jnp.broadcast_to(_E4M3_NAN_F32, data.shape)
        mask = jnp.broadcast_to(nan_block, data.shape)
    elif fmt.scale_mode == "rceil":
        nan_bits = jnp.broadcast_to(mab[..., None] | _QUIET, data.shape)
        mask = jnp.broadcast_to(nan_block, data.shape)
    else:
        mag = bits & np.uint32(0x7FFFFFFF)
        nan_bits = jnp.where(mag == np.uint32(0x7F800000), _DEFAULT_NAN, bits | _QUIET)
        mask = nan_block & (mag >= np.uint32(0x7F800000))
    return mask, _bits.nan_codes(nan_bits, fmt.element)


def _element_bits(scaled: jax.Array, fmt: Format) -> jax.Array:
    """Element codes as uint8 (selecting among float8 NaNs can rewrite their bits)."""
    fmax = np.float32(fmt.max)
    scaled = jnp.clip(scaled, -fmax, fmax)  # keeps NaN
    if fmt.packed:
        return _bits.e2m1_codes(scaled)
    return jax.lax.bitcast_convert_type(scaled.astype(fmt.dtype), jnp.uint8)


def to_block_scaled(
    x: Any,
    fmt: Format | str = "mxfp8",
    axis: int = -1,
    *,
    per_tensor_scale: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Block-quantize `x` along `axis`: ``(codes, scales)``, bit-identical to torchao's.

    MX formats follow ``torchao.prototype.mx_formats.mx_tensor.to_mx``; NVFP4 follows
    ``nvfp4_tensor.nvfp4_quantize``. torchao always blocks the last axis; `axis` moves any axis
    there first (a linear layer's weight is blocked along its input features for the forward
    matmul and along its output features for ``grad_input``).

    Args:
      x: float32, bfloat16 or float16 array (float16 is widened to float32 exactly; torchao
        refuses it). ``x.shape[axis]`` must be a multiple of the block size.
      fmt: a `Format` or format name (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``, ...).
      axis: the axis whose consecutive elements form blocks.
      per_tensor_scale: NVFP4 only: the float32 tensor scale of two-level scaling
        (`per_tensor_scale`), or None for one level.

    Returns:
      ``(codes, scales)``. Codes: float8 arrays shaped like `x` for MXFP8; for e2m1 formats,
      uint8 bytes holding two codes each (the first in the low nibble) with ``axis`` halved.
      Scales, shaped like `x` with ``axis`` divided by the block size: uint8 biased exponents
      (the bits of torchao's ``float8_e8m0fnu``; 255 marks a NaN block) for MX, float8_e4m3fn
      for NVFP4.

    Raises:
      ValueError: a non-float `x`, an axis not a multiple of the block size, or a
        `per_tensor_scale` with an MX format.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.mx
      >>> codes, scales = jaxamp.mx.to_block_scaled(jnp.full((2, 32), 3.0), "mxfp8")
      >>> codes.dtype, scales.tolist()  # 3.0 = 384 * 2**-7: exponent 1 - 8 + 127
      (dtype(float8_e4m3fn), [[120], [120]])
    """
    fmt = _make_format(fmt)
    x, axis = _check_input(x, fmt, axis, "jaxamp.mx.to_block_scaled")
    data = _blocks(_bits.to_float32(x), axis, fmt.block_size)
    # max over the bits: exact for subnormals, NaN (above inf) wherever the block has one
    mab = jnp.max(_bits.abs_bits(data), axis=-1)
    nan_block = (mab > np.uint32(0x7F800000))[..., None]
    if fmt.scale == "e8m0":
        if per_tensor_scale is not None:
            raise ValueError(
                f"jaxamp.mx.to_block_scaled: per_tensor_scale is NVFP4's two-level scaling; {fmt.name} "
                "has e8m0 block scales only."
            )
        scales = e8m0_exponent(mab, fmt)
        scaled = _scaled_mx(data, scales, fmt)
        scaled = jnp.where(nan_block, data * np.float32(0.0), scaled)  # x / inf, finite x
    else:
        pts = None
        if per_tensor_scale is not None:
            pts = jnp.asarray(per_tensor_scale, jnp.float32)
            if pts.size != 1:
                raise ValueError(
                    f"jaxamp.mx.to_block_scaled: per_tensor_scale must be one float32 value; got shape "
                    f"{pts.shape}."
                )
            pts = pts.reshape(())
        scales, factor = nvfp4_scales(jax.lax.bitcast_convert_type(mab, jnp.float32), pts)
        factor = factor[..., None]
        # a subnormal element (mantissa * 2**-149) times the factor, rounded once: the mantissa
        # times 2**-64 (exact), times the factor (the one rounding), times 2**-85 (exact where
        # the result is normal; smaller results are zeros in e2m1)
        bits = _bits.f32_bits(data)
        sub = ((bits >> 23) & 0xFF) == 0
        mant = jax.lax.bitcast_convert_type(
            _bits.f32_bits((bits & 0x7FFFFF).astype(jnp.float32)) | (bits & np.uint32(0x80000000)),
            jnp.float32,
        )
        tiny = _bits.mul_pow2(_bits.mul_pow2(mant, -64) * factor, -85)
        scaled = jnp.where(sub, tiny, data * factor)
    mask, nan_codes = _nan_overrides(data, nan_block, mab, fmt)
    codes = jnp.where(mask, nan_codes, _element_bits(scaled, fmt))
    codes = _unblocks(codes, axis)
    if fmt.packed:
        codes = jnp.moveaxis(_bits.pack_nibbles(jnp.moveaxis(codes, axis, -1)), -1, axis)
    else:
        codes = jax.lax.bitcast_convert_type(codes, fmt.dtype)
    return codes, jnp.moveaxis(scales, -1, axis)


def scales_to_float32(scales: jax.Array, fmt: Format | str = "mxfp8") -> jax.Array:
    """Block scales as float32 values (``2**(code - 127)``, NaN for code 255; NVFP4: e4m3 values).

    A code-0 scale, 2**-127, is a float32 subnormal: it comes back as 0 on backends that flush
    subnormals (XLA:CPU).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.mx
      >>> jaxamp.mx.scales_to_float32(jnp.array([120, 127, 255], jnp.uint8)).tolist()
      [0.0078125, 1.0, nan]
    """
    fmt = _make_format(fmt)
    if fmt.scale == "e4m3":
        return widen(jnp.asarray(scales))
    codes = jnp.asarray(scales).astype(jnp.int32)
    value = _bits.mul_pow2(jnp.ones(codes.shape, jnp.float32), codes - E8M0_BIAS)
    return jnp.where(codes == E8M0_NAN, np.float32(np.nan), value)


def from_block_scaled(
    codes: Any,
    scales: Any,
    fmt: Format | str = "mxfp8",
    axis: int = -1,
    dtype: Any = jnp.float32,
    *,
    per_tensor_scale: Any = None,
) -> jax.Array:
    """Inverse of `to_block_scaled`: element values times their block scale, in `dtype` (torchao's
    ``MXTensor.dequantize`` / ``NVFP4Tensor.dequantize``).

    MX: each value times ``2**(scale - 127)``, exact (a NaN block is NaN); values below float32's
    smallest normal flush to zero on XLA:CPU, where torch keeps them subnormal. NVFP4: values
    times ``per_tensor_scale * scale`` (that product rounded to float32 first, as torchao).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.mx
      >>> x = jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)
      >>> c, s = jaxamp.mx.to_block_scaled(x, "mxfp4")
      >>> y = jaxamp.mx.from_block_scaled(c, s, "mxfp4")
      >>> y.shape, float(jnp.max(jnp.abs(y - x))) <= 0.125
      ((2, 32), True)
    """
    fmt = _make_format(fmt)
    codes, scales = jnp.asarray(codes), jnp.asarray(scales)
    axis = int(axis) % codes.ndim
    c = jnp.moveaxis(codes, axis, -1)
    if fmt.packed:
        values = _bits.e2m1_values(_bits.unpack_nibbles(c))
    else:
        values = widen(c)  # codes rounded in this program stay rounded under XLA:GPU
    values = values.reshape(*values.shape[:-1], -1, fmt.block_size)
    s = jnp.moveaxis(scales, axis, -1)[..., None]
    if fmt.scale == "e8m0":
        s = s.astype(jnp.int32)
        out = _bits.mul_pow2(values, s - E8M0_BIAS)
        out = jnp.where(s == E8M0_NAN, np.float32(np.nan), out)
    else:
        hp = widen(s)
        if per_tensor_scale is not None:
            hp = jnp.asarray(per_tensor_scale, jnp.float32).reshape(()) * hp
        out = values * hp
    return _unblocks(out, axis).astype(dtype)


def per_tensor_scale(amax: Any) -> jax.Array:
    """NVFP4's float32 tensor scale from a tensor's amax: ``amax / (448 * 6)`` (torchao's
    ``per_tensor_amax_to_scale``), so a block holding the amax gets the e4m3 scale 448.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.mx
      >>> float(jaxamp.mx.per_tensor_scale(jnp.float32(2688.0)))
      1.0
    """
    return _bits.divide(jnp.asarray(amax).astype(jnp.float32), np.float32(448.0 * 6.0))
