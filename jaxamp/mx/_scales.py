"""Per-block scales: torchao's e8m0 exponent rules (FLOOR, CEIL, EVEN, RCEIL) and NVFP4's e4m3 scales.

Every rule is decided from bit patterns or precomputed thresholds, never from a float operation
on a possibly subnormal value (the backend would flush it; see `jaxamp.mx._bits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._numerics import eager_as_one_program, widen
from jaxamp.mx._bits import divide
from jaxamp.mx._formats import Format

__all__ = ["E8M0_NAN", "e8m0_exponent", "nvfp4_scales", "rceil_thresholds"]

E8M0_BIAS = 127
E8M0_NAN = 255  # the e8m0 code of a block whose amax is NaN
_F32_INF_BITS = np.uint32(0x7F800000)
_E4M3_TINY = np.float32(2.0**-6)  # float8_e4m3fn's smallest normal: NVFP4's smallest block scale


def _rceil_exponent_host(max_abs_bits: np.ndarray, max_pos: float) -> np.ndarray:
    """``clamp(ceil(log2(float32(amax / max_pos))), -127, 127)`` for finite amax bit patterns,
    with IEEE subnormals and a correctly rounded float32 log2 (float64 log2, rounded)."""
    amax = max_abs_bits.astype(np.uint32).view(np.float32)
    with np.errstate(divide="ignore", under="ignore"):
        descale = amax / np.float32(max_pos)  # numpy keeps float32 subnormals
        log2 = np.log2(descale.astype(np.float64)).astype(np.float32)
    return np.clip(np.ceil(log2), -E8M0_BIAS, E8M0_BIAS)


@functools.cache
def rceil_thresholds(max_pos: float) -> np.ndarray:
    """``t[i]``: the smallest float32 amax (as bits) whose RCEIL exponent is ``>= i - 126``.

    RCEIL (torchao's ``_to_mx_rceil``, cuBLAS's UE8M0 rule) is ``ceil(log2(amax / max_pos))``
    on float32 values: a division that may land in the subnormal range and a float32 log2 that
    rounds ``log2`` of a value just above ``2**k`` down to ``k``. The exponent is monotone in
    the amax, so it is the count of thresholds at or below the amax's bit pattern: 254 of them
    (exponents -126..127), found by bisection over float32 bit patterns on the host.
    """
    ks = np.arange(-126, 128)
    lo = np.zeros(ks.shape, np.int64)  # exponent(lo) < k  (amax 0 gives -127)
    hi = np.full(ks.shape, int(_F32_INF_BITS), np.int64)  # exponent(hi) >= k, or unreachable
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        ok = _rceil_exponent_host(mid.astype(np.uint32), max_pos) >= ks
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
    return hi.astype(np.uint32)


@functools.partial(eager_as_one_program, static_argnames="fmt")
def e8m0_exponent(max_abs_bits: jax.Array, fmt: Format) -> jax.Array:
    """The biased e8m0 scale code (uint8) of blocks whose ``|amax|`` has bits `max_abs_bits`.

    FLOOR/CEIL/EVEN (torchao's ``to_mx``): the amax's float32 exponent field, minus the element
    format's ``emax``; CEIL adds one where the amax has mantissa bits, EVEN first rounds the amax
    to the element's mantissa width; clamped to [-127, 128] and biased by 127. RCEIL
    (``_to_mx_rceil``): see `rceil_thresholds`; inf gives 254. A NaN amax gives 255 in all modes.
    """
    mb = max_abs_bits.astype(jnp.uint32)
    is_nan = mb > _F32_INF_BITS
    mode = fmt.scale_mode
    if mode == "rceil":
        t = jnp.asarray(rceil_thresholds(fmt.max))
        unbiased = jnp.searchsorted(t, mb, side="right").astype(jnp.int32) - E8M0_BIAS
        unbiased = jnp.where(mb == _F32_INF_BITS, E8M0_BIAS, unbiased)
    else:
        if mode == "even":
            half = np.uint32(1 << (23 - fmt.mantissa_bits - 1))
            mb = (mb + half) & np.uint32(0xFF800000)
        unbiased = ((mb >> 23) & 0xFF).astype(jnp.int32) - E8M0_BIAS
        if mode == "ceil":
            unbiased = unbiased + ((mb & 0x7FFFFF) > 0).astype(jnp.int32)
        unbiased = jnp.clip(unbiased - fmt.emax, -E8M0_BIAS, E8M0_BIAS + 1)
    biased = (unbiased + E8M0_BIAS).astype(jnp.uint8)
    return jnp.where(is_nan, np.uint8(E8M0_NAN), biased)


def nvfp4_scales(max_abs: jax.Array, per_tensor_scale: jax.Array | None):
    """NVFP4's block scales (torchao's ``nvfp4_quantize``): ``(e4m3 scales, float32 factor)``.

    The scale is ``amax / 6`` (divided by `per_tensor_scale` with two-level scaling), clamped to
    [2**-6, 448] and rounded to float8_e4m3fn; elements are multiplied by the factor
    ``1 / scale`` (``(1 / per_tensor_scale) / scale``), each reciprocal rounded to float32.
    """
    block = divide(max_abs.astype(jnp.float32), np.float32(6.0))
    if per_tensor_scale is not None:
        block = divide(block, per_tensor_scale)
    s8 = jnp.clip(block, _E4M3_TINY, np.float32(448.0)).astype(jnp.float8_e4m3fn)
    s32 = widen(s8)  # the e4m3 rounding stays in a jitted program on GPU
    if per_tensor_scale is None:
        return s8, np.float32(1.0) / s32
    inverse = jax.lax.optimization_barrier(np.float32(1.0) / per_tensor_scale)
    return s8, inverse / s32
