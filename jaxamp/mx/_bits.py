"""Exact float32 arithmetic for block quantizers on a backend that flushes subnormals.

XLA:CPU (like GPUs and TPUs) treats subnormal float32 inputs as zero and flushes subnormal
results; torch on CPU computes with IEEE subnormals. A block quantizer divides each element by
a power of two as small as 2**-127, so an element that is subnormal in float32 can become an
ordinary fp8 value. The helpers here decide such steps from the bit patterns, so the quantized
codes equal an IEEE computation's wherever a result is large enough to survive the element cast
(every result below 2**-60 is zero in all element formats, keeping its sign).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._numerics import divide, eager_as_one_program

__all__ = [
    "E2M1_VALUES",
    "abs_bits",
    "divide",
    "nan_codes",
    "e2m1_codes",
    "e2m1_values",
    "f32_bits",
    "mul_pow2",
    "pack_nibbles",
    "pow2",
    "to_float32",
    "unpack_nibbles",
]

# The eight magnitudes of float4_e2m1fn (code 0..7; bit 3 is the sign).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_SIGN = np.uint32(0x80000000)


def f32_bits(x: jax.Array) -> jax.Array:
    """The uint32 bit pattern of float32 `x`."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _from_bits(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def abs_bits(x: jax.Array) -> jax.Array:
    """Bits of ``|x|``: for non-negative floats (NaN above inf) their order is the numbers' order."""
    return f32_bits(x) & np.uint32(0x7FFFFFFF)


def pow2(k: jax.Array) -> jax.Array:
    """``2.0**k`` in float32 for integer ``k`` in [-126, 127] (normal), built from its bits."""
    return _from_bits((jnp.asarray(k, jnp.int32) + 127).astype(jnp.uint32) << 23)


def to_float32(x: jax.Array) -> jax.Array:
    """`x` as float32, exactly, subnormals included (bfloat16 by its bits, float16 by parts)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.float32:
        return x
    if x.dtype == jnp.bfloat16:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
        return _from_bits(bits)
    if x.dtype == jnp.float16:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        mant = (bits & 0x3FF).astype(jnp.float32)
        sub = ((bits >> 10) & 0x1F) == 0
        # a float16 subnormal is mant * 2**-24: a normal float32
        tiny = mant * np.float32(2.0**-24)
        tiny = _from_bits(f32_bits(tiny) | ((bits & 0x8000) << 16))
        return jnp.where(sub, tiny, x.astype(jnp.float32))
    raise TypeError(f"to_float32: expected a float16/bfloat16/float32 array; got {x.dtype}.")


@eager_as_one_program
def mul_pow2(x: jax.Array, p: jax.Array) -> jax.Array:
    """``x * 2.0**p`` rounded once, as IEEE float32 arithmetic gives it, for subnormal `x` too.

    `p` is an integer array broadcastable to `x`, in [-300, 300]. A subnormal `x` is read as
    ``mantissa * 2**-149`` (a normal number times a power of two); the power is applied in two
    normal factors, the first exact. Results below float32's smallest normal come back as a
    signed zero (the backend flushes them), results past its range as infinity.
    """
    x = x.astype(jnp.float32)
    p = jnp.asarray(p, jnp.int32)
    bits = f32_bits(x)
    sub = ((bits >> 23) & 0xFF) == 0
    mant = (bits & 0x7FFFFF).astype(jnp.float32)
    mant = _from_bits(f32_bits(mant) | (bits & _SIGN))
    base = jnp.where(sub, mant, x)
    p = jnp.where(sub, p - 149, p)
    p1 = jnp.clip(p, -126, 127)
    p2 = jnp.clip(p - p1, -126, 127)
    return base * pow2(p1) * pow2(p2)


def nan_codes(nan_bits: jax.Array, element: str) -> jax.Array:
    """The element code torch writes for float32 NaNs with bit patterns `nan_bits` (uint32).

    float8: all exponent and mantissa bits set, the NaN's sign kept (``0x7F``/``0xFF``; XLA
    writes another NaN for e5m2). e2m1 has no NaN: torchao's integer rounding of the NaN's bits
    (`e2m1_codes`). Deciding from the bits keeps the result independent of how the compiler
    propagates NaN payloads through arithmetic.
    """
    nan_bits = nan_bits.astype(jnp.uint32)
    if element == "e2m1":
        return e2m1_codes(_from_bits(nan_bits))
    return (((nan_bits >> 24) & 0x80) | 0x7F).astype(jnp.uint8)


@eager_as_one_program
def e2m1_codes(x: jax.Array) -> jax.Array:
    """float32 -> float4_e2m1fn codes (uint8, 0..15) as torchao's ``f32_to_f4_unpacked``.

    Round to nearest even; magnitudes >= 6 (and inf) saturate to 6 (code 7); magnitudes below 1
    round to 0, 0.5 or 1. A NaN has no e2m1 code: torchao's integer rounding turns its bits
    into a finite code (canonical NaN: 1.5, code 3) keeping the sign bit, and so does this.
    """
    bits = f32_bits(x)
    sign = ((bits >> 28) & 8).astype(jnp.uint8)
    mag_bits = bits & np.uint32(0x7FFFFFFF)
    mag = _from_bits(mag_bits)
    # [1, 6) and NaN: rebias the exponent (127 -> 1) and round the 23-bit fraction to one bit,
    # nearest-even (add 2**21 - 1 plus the kept bit's parity, drop 22 bits).
    odd = (mag_bits >> 22) & 1
    normal = ((mag_bits - np.uint32(126 << 23) + np.uint32((1 << 21) - 1) + odd) >> 22) & 0xFF
    # [0, 1): multiples of 0.5, nearest-even (a subnormal is 0 here and in torchao)
    small = jnp.round(mag * 2.0).astype(jnp.uint32)
    code = jnp.where(mag >= 6.0, np.uint32(7), jnp.where(mag < 1.0, small, normal))
    return code.astype(jnp.uint8) | sign


@eager_as_one_program
def e2m1_values(codes: jax.Array) -> jax.Array:
    """float4_e2m1fn codes (uint8, 0..15) -> float32 values."""
    codes = codes.astype(jnp.int32)
    mag = jnp.asarray(E2M1_VALUES)[codes & 7]
    return jnp.where((codes & 8) != 0, -mag, mag)


@eager_as_one_program
def pack_nibbles(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte along the last axis: element 2i low nibble, 2i+1 high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: the last axis ({codes.shape[-1]}) must be even.")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2).astype(jnp.uint8)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


@eager_as_one_program
def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_nibbles`: ``(..., n)`` bytes -> ``(..., 2n)`` codes."""
    packed = packed.astype(jnp.uint8)
    both = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return both.reshape(*packed.shape[:-1], -1)
