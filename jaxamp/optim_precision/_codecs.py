"""Block-wise codes for optimizer state: torchao's 8-bit, 4-bit and fp8 schemes, and bf16.

Every format keeps a float32 value per element as a code and, for the block formats, one float32
scale per block of `block_size` consecutive elements (row-major over the whole leaf, as torchao
reshapes to ``(-1, block_size)``):

* ``"8bit"``: ``uint8`` codes into bitsandbytes' dynamic-tree map (signed or unsigned), the
  elements divided by their block's largest magnitude (torchao ``OptimState8bit``, block 256).
* ``"4bit"``: two 4-bit codes per ``uint8`` (first element in the high nibble); the signed map
  is the dynamic map with 3 exponent bits, the unsigned one linear without zero (torchao
  ``OptimState4bit``, block 128).
* ``"fp8"``: ``float8_e4m3fn`` codes of the elements divided by ``amax / 448`` (torchao
  ``OptimStateFp8``, block 256).
* ``"bf16"``: the leaf stored as bfloat16 (round to nearest even); no scale.

Codes round as torchao's do: the map code at or below the value, or the next one up when the
value lies at or above the midpoint (``quantize_8bit_with_qmap``); fp8 rounds to nearest even.

A `BlockOrder` takes the blocks in another element order: that of the same tensor in another
layout, e.g. a Flax ``Dense`` kernel ``(in, out)`` blocked as torch's ``Linear`` weight
``(out, in)`` is (torchao blocks torch's row-major order: a twin's codes equal torchao's only when
its blocks hold the same elements).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._numerics import divide, eager_as_one_program
from jaxamp.optim_precision import _qmaps

__all__ = [
    "BLOCK_FORMATS",
    "BlockOrder",
    "DEFAULT_BLOCK_SIZE",
    "STATE_FORMATS",
    "QuantizedArray",
    "decode_blockwise",
    "encode_blockwise",
]

# The formats `low_precision_state` takes, and the default block size of each block format
# (torchao 0.18's AdamW8bit / AdamW4bit / AdamWFp8 defaults).
DEFAULT_BLOCK_SIZE = {"8bit": 256, "4bit": 128, "fp8": 256}
BLOCK_FORMATS = tuple(DEFAULT_BLOCK_SIZE)
STATE_FORMATS = ("bf16", *BLOCK_FORMATS)

_QMAPS = {
    ("8bit", True): _qmaps.SIGNED_8BIT,
    ("8bit", False): _qmaps.UNSIGNED_8BIT,
    ("4bit", True): _qmaps.SIGNED_4BIT,
    ("4bit", False): _qmaps.UNSIGNED_4BIT,
}
_FP8 = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(_FP8).max)  # 448
# torch's `.clip(1e-12)` on the block amax: an all-zero block divides by this, not by 0.
_TINY_AMAX = np.float32(1e-12)


class BlockOrder:
    """The element order blocks are taken in: element ``i`` of the blocked sequence is
    ``x.reshape(-1)[order[i]]`` (a permutation of ``range(x.size)``).

    Static (hashable, compared by value) so that it can live in a `QuantizedArray`'s static
    fields: the order is part of the state's structure, not of its arrays (no bytes in the state).

    Args:
      order: a 1-D integer array holding each of ``0 .. size - 1`` once.

    Raises:
      ValueError: `order` is not a permutation (names the first missing or repeated index).

    Examples:
      Torch's ``Linear`` weight ``(out, in)`` is a Flax kernel ``(in, out)`` transposed; its
      blocks in torch's row-major order:

      >>> from jaxamp.optim_precision import BlockOrder
      >>> kernel_shape = (3, 2)  # (in, out)
      >>> BlockOrder(np.arange(6).reshape(kernel_shape).T.reshape(-1)).order
      array([0, 2, 4, 1, 3, 5], dtype=int32)
    """

    __slots__ = ("_hash", "inverse", "order")

    def __init__(self, order: Any):
        try:
            array = np.asarray(order)
        except Exception:  # noqa: BLE001 - a value numpy cannot read is reported as such
            array = None
        if array is None or array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"BlockOrder(order=...): must be a 1-D integer array (a permutation of "
                f"0 .. size - 1); got {_describe(order)}."
            )
        size = array.shape[0]
        counts = np.bincount(np.clip(array, 0, max(size - 1, 0)), minlength=size)
        if size and (array.min() < 0 or array.max() >= size or (counts != 1).any()):
            bad = (array < 0) | (array >= size)
            if bad.any():
                detail = f"index {int(array[np.argmax(bad)])} is outside 0 .. {size - 1}"
            else:
                detail = f"index {int(np.argmax(counts != 1))} appears {int(counts.max())} times"
            raise ValueError(
                f"BlockOrder(order=...): must hold each of 0 .. {size - 1} exactly once; {detail}."
            )
        self.order = array.astype(np.int32)
        self.order.setflags(write=False)
        self.inverse = np.argsort(self.order).astype(np.int32)
        self.inverse.setflags(write=False)
        self._hash = hash((size, self.order.tobytes()))

    @property
    def size(self) -> int:
        return int(self.order.shape[0])

    @property
    def is_identity(self) -> bool:
        return bool((self.order == np.arange(self.size)).all())

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, BlockOrder)
            and self._hash == other._hash
            and np.array_equal(self.order, other.order)
        )

    def __repr__(self) -> str:
        return f"BlockOrder(size={self.size})"


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None:
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    return repr(value)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """One optimizer-state leaf kept as block-wise codes (see the module docstring).

    Attributes:
      codes: ``uint8`` of the leaf's shape (``"8bit"``), ``uint8`` of ``(size // 2,)`` with two
        codes per byte (``"4bit"``), or ``float8_e4m3fn`` of the leaf's shape (``"fp8"``).
      scale: float32 of shape ``(size // block_size,)``: each block's scale.
      state_format: ``"8bit"``, ``"4bit"`` or ``"fp8"`` (static).
      signed: whether the map covers negative values (first moments) or not (second moments;
        static).
      shape: the shape of the float32 value (static).
      block_size: elements per scale (static).
      order: the `BlockOrder` the blocks are taken in, or None (row-major; static). With an
        order, 8-bit and fp8 codes are 1-D, in block order.

    Examples:
      >>> from jaxamp.optim_precision import decode_blockwise, encode_blockwise
      >>> q = encode_blockwise(jnp.linspace(-1.0, 1.0, 256), "8bit", signed=True, block_size=128)
      >>> q.codes.dtype, q.codes.shape, q.scale.shape
      (dtype('uint8'), (256,), (2,))
      >>> bool(jnp.abs(decode_blockwise(q) - jnp.linspace(-1.0, 1.0, 256)).max() < 0.02)
      True
    """

    codes: jax.Array
    scale: jax.Array
    state_format: str = dataclasses.field(metadata={"static": True})
    signed: bool = dataclasses.field(metadata={"static": True})
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    block_size: int = dataclasses.field(metadata={"static": True})
    order: BlockOrder | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def nbytes(self) -> int:
        """Bytes held: codes plus scales (the map is a shared constant)."""
        return int(self.codes.nbytes) + int(self.scale.nbytes)


@functools.partial(eager_as_one_program, static_argnames="bits")
def _search(x: jax.Array, qmap: jax.Array, bits: int) -> jax.Array:
    """torchao's branchless binary search: the largest code whose map value is <= x (0 below
    the map, and for NaN, as torch's comparisons give), then up one where x is at or past the
    midpoint to the next value."""
    top = qmap.shape[0] - 1
    codes = jnp.where(x >= qmap[1 << (bits - 1)], 1 << (bits - 1), 0).astype(jnp.int32)
    for shift in range(bits - 2, -1, -1):
        step = 1 << shift
        codes = codes + jnp.where(x >= jnp.take(qmap, codes + step), step, 0).astype(jnp.int32)
    codes_up = jnp.minimum(codes + 1, top)
    value_down = jnp.take(qmap, codes)
    value_up = jnp.take(qmap, codes_up)
    round_up = (x - value_down) >= (value_up - value_down) * jnp.float32(0.5)
    return jnp.where(round_up, codes_up, codes).astype(jnp.uint8)


def _blocks(x: jax.Array, block_size: int, order: BlockOrder | None) -> jax.Array:
    x = x.astype(jnp.float32).reshape(-1)
    if order is not None:
        x = jnp.take(x, jnp.asarray(order.order))
    return x.reshape(-1, block_size)


def encode_blockwise(
    x: jax.Array,
    state_format: str,
    *,
    signed: bool = True,
    block_size: int | None = None,
    order: BlockOrder | None = None,
) -> QuantizedArray:
    """Encodes `x` as block-wise codes, exactly as torchao 0.18 stores an optimizer state.

    Args:
      x: a floating array (any of float16/bfloat16/float32; computed in float32) whose size is a
        multiple of `block_size`.
      state_format: ``"8bit"``, ``"4bit"`` or ``"fp8"``.
      signed: the signed map (first moments) or the unsigned one (second moments); fp8 ignores
        it (its codes carry a sign).
      block_size: elements per scale; default torchao's (256, 128, 256).
      order: a `BlockOrder` of `x`'s size (the blocks in another layout's element order), or
        None (row-major).

    Returns:
      A `QuantizedArray`; `decode_blockwise` gives float32 back.

    Examples:
      >>> from jaxamp.optim_precision import encode_blockwise
      >>> q = encode_blockwise(jnp.arange(512.0), "fp8")
      >>> q.codes.dtype, q.scale.shape
      (dtype(float8_e4m3fn), (2,))
      >>> (q.scale * 448).round().tolist()  # each block's scale: its largest magnitude / 448
      [255.0, 511.0]
    """
    if state_format not in BLOCK_FORMATS:
        raise ValueError(_unknown_format("encode_blockwise", state_format, BLOCK_FORMATS))
    block_size = _check_block_size("encode_blockwise", state_format, block_size)
    size = math.prod(x.shape)
    if size % block_size:
        raise ValueError(
            f"encode_blockwise(x=...): size {size} (shape {tuple(x.shape)}) is not a multiple of "
            f"block_size={block_size}; low_precision_state keeps such leaves unquantized."
        )
    if order is not None and (not isinstance(order, BlockOrder) or order.size != size):
        raise ValueError(
            f"encode_blockwise(order={order!r}): must be a BlockOrder of size {size} (x's shape "
            f"{tuple(x.shape)}) or None."
        )
    blocks = _blocks(x, block_size, order)
    # Row-major codes keep x's shape (they shard like it); codes in another order are 1-D.
    code_shape = tuple(x.shape) if order is None else (size,)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    if state_format == "fp8":
        scale = divide(jnp.maximum(amax, _TINY_AMAX), jnp.float32(_FP8_MAX))
        codes = divide(blocks, scale[:, None]).astype(_FP8).reshape(code_shape)
        return QuantizedArray(codes, scale, "fp8", bool(signed), tuple(x.shape), block_size, order)
    scale = jnp.maximum(amax, _TINY_AMAX)
    qmap = jnp.asarray(_QMAPS[state_format, bool(signed)])
    bits = 8 if state_format == "8bit" else 4
    codes = _search(divide(blocks, scale[:, None]), qmap, bits)
    if state_format == "8bit":
        codes = codes.reshape(code_shape)
    else:
        pairs = codes.reshape(-1, 2)
        codes = (pairs[:, 0] << 4) | pairs[:, 1]
    return QuantizedArray(
        codes, scale, state_format, bool(signed), tuple(x.shape), block_size, order
    )


def decode_blockwise(q: QuantizedArray) -> jax.Array:
    """The float32 values of `q` (map value times block scale, as torchao's ``dequantize``).

    Examples:
      The signed maps end at 1.0 but start above -1 (-0.8875 for 4 bits, -0.993 for 8), as
      torchao's: a block's most negative value comes back smaller in magnitude.

      >>> from jaxamp.optim_precision import decode_blockwise, encode_blockwise
      >>> round_trip = jax.jit(lambda x: decode_blockwise(encode_blockwise(x, "4bit", signed=True)))
      >>> round_trip(jnp.full(128, -2.0))[:3]
      Array([-1.775, -1.775, -1.775], dtype=float32)
      >>> round_trip(jnp.full(128, 2.0))[:3]
      Array([2., 2., 2.], dtype=float32)
    """
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"decode_blockwise(q=...) takes a QuantizedArray; got {type(q).__name__}.")
    if q.state_format == "fp8":
        values = q.codes.astype(jnp.float32).reshape(-1, q.block_size)
    else:
        codes = q.codes
        if q.state_format == "4bit":
            codes = jnp.stack([codes >> 4, codes & 0b1111], axis=-1)
        qmap = jnp.asarray(_QMAPS[q.state_format, q.signed])
        values = jnp.take(qmap, codes.astype(jnp.int32).reshape(-1, q.block_size))
    values = (values * q.scale[:, None]).reshape(-1)
    if q.order is not None:
        values = jnp.take(values, jnp.asarray(q.order.inverse))
    return values.reshape(q.shape)


def _unknown_format(caller: str, value: Any, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value).lower(), allowed, n=1, cutoff=0.4)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"{caller}(state_format={value!r}): unknown format{hint} Formats: {', '.join(allowed)}."


def _check_block_size(caller: str, state_format: str, block_size: Any) -> int:
    if block_size is None:
        return DEFAULT_BLOCK_SIZE[state_format]
    if (
        isinstance(block_size, (bool, np.bool_))
        or not isinstance(block_size, (int, np.integer))
        or block_size < 1
        or (state_format == "4bit" and block_size % 2)
    ):
        need = "an even int >= 2 (two codes per byte)" if state_format == "4bit" else "an int >= 1"
        raise ValueError(
            f"{caller}(block_size={block_size!r}): must be {need} or None (torchao's "
            f"{DEFAULT_BLOCK_SIZE[state_format]} for {state_format!r})."
        )
    return int(block_size)
