"""Block-scaled element formats as data: MXFP8, MXFP4 (OCP MX 1.0) and NVFP4, with their scale rules."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["FORMAT_NAMES", "SCALE_MODES", "Format", "get_format"]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
E2M1 = np.dtype(jnp.float4_e2m1fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)

# torchao's ScaleCalculationMode values. FLOOR is the OCP MX 1.0 rule and torchao's default.
SCALE_MODES = ("floor", "rceil", "ceil", "even")
_ELEMENTS = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}
_ELEMENT_ALIASES = {
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float4_e2m1fn": "e2m1",
    "float4_e2m1fn_x2": "e2m1",
}
# Per element format: (largest finite value, exponent of the largest power of two <= it,
# mantissa bits). The power of two is what FLOOR/CEIL/EVEN subtract from the block's exponent.
ELEMENT_LIMITS = {"e4m3": (448.0, 8, 3), "e5m2": (57344.0, 15, 2), "e2m1": (6.0, 2, 1)}
FORMAT_NAMES = ("mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4")


def _closest(value: Any, allowed) -> str:
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _element_name(value: Any) -> str:
    if isinstance(value, str):
        name = _ELEMENT_ALIASES.get(value, value)
    else:
        try:
            dtype = np.dtype(value)
        except TypeError:
            dtype = None
        name = next((k for k, d in _ELEMENTS.items() if d == dtype), None)
    if name not in _ELEMENTS:
        raise ValueError(
            f"Format: element must be one of {tuple(_ELEMENTS)} (or float8_e4m3fn, float8_e5m2, "
            f"float4_e2m1fn); got {value!r}.{_closest(value, list(_ELEMENTS) + list(_ELEMENT_ALIASES))}"
        )
    return name


@dataclasses.dataclass(frozen=True)
class Format:
    """A block-scaled format: elements, block size, and how each block's scale is chosen.

    Two scale kinds, as torchao implements them:

    * ``"e8m0"`` (the MX formats, ``torchao.prototype.mx_formats.mx_tensor.to_mx``): one
      power-of-two scale per `block_size` consecutive elements, stored as a biased 8-bit
      exponent (``float8_e8m0fnu``; 255 marks a block holding NaN). `scale_mode` picks the
      exponent: ``"floor"`` (``floor(log2(amax)) - emax``, the OCP MX 1.0 rule, torchao's
      default), ``"ceil"`` (rounded up where amax is not a power of two), ``"even"`` (amax first
      rounded to the element's mantissa width), ``"rceil"`` (``ceil(log2(amax / max))``: cuBLAS's
      rule for UE8M0 scales, the default of torchao's MXFP8 training op). ``emax`` is the
      largest power of two of the element format (8 for e4m3, 15 for e5m2, 2 for e2m1).
    * ``"e4m3"`` (NVFP4, ``torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize``): one
      float8_e4m3fn scale per 16 elements, ``amax / 6`` rounded to e4m3 (clamped to
      [2**-6, 448]), optionally divided by a float32 per-tensor scale first (two-level scaling;
      torchao's ``per_tensor_amax_to_scale``: ``amax / (448 * 6)``).

    Attributes:
      name: the format's name (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``, or a user's).
      element: ``"e4m3"``, ``"e5m2"`` or ``"e2m1"`` (the element dtype's short name).
      block_size: elements per scale (32 for MX, 16 for NVFP4).
      scale: ``"e8m0"`` or ``"e4m3"``.
      scale_mode: for e8m0 scales, one of ``SCALE_MODES``; None for e4m3 scales.

    Examples:
      A format of your own (`jaxamp.mx.get_format` makes the named ones): MXFP8 with e5m2
      elements and scales rounded up, used as a named one is:

      >>> import jax.numpy as jnp, jaxamp.mx
      >>> fmt = jaxamp.mx.Format("e5m2_ceil", element="e5m2", scale_mode="ceil")
      >>> str(fmt), fmt.max, fmt.emax
      ('e5m2_ceil(e5m2, 32x e8m0 scale, ceil)', 57344.0, 15)
      >>> codes, scales = jaxamp.mx.to_block_scaled(jnp.full((2, 32), 3.0), fmt)
      >>> codes.dtype, scales.tolist()  # ceil: log2(3.0) rounded up is 2; 2 - emax + 127
      (dtype(float8_e5m2), [[114], [114]])
      >>> jaxamp.mx.from_block_scaled(codes, scales, fmt)[0, :2].tolist()
      [3.0, 3.0]
    """

    name: str
    element: str = "e4m3"
    block_size: int = 32
    scale: str = "e8m0"
    scale_mode: str | None = "floor"

    def __post_init__(self):
        object.__setattr__(self, "element", _element_name(self.element))
        if self.scale not in ("e8m0", "e4m3"):
            raise ValueError(
                f"Format {self.name!r}: scale must be 'e8m0' (MX) or 'e4m3' (NVFP4); got "
                f"{self.scale!r}.{_closest(self.scale, ('e8m0', 'e4m3'))}"
            )
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int | np.integer)
            or self.block_size < 2
            or self.block_size % 2
        ):
            raise ValueError(
                f"Format {self.name!r}: block_size must be an even int >= 2 (32 for MX, 16 for "
                f"NVFP4); got {self.block_size!r}."
            )
        object.__setattr__(self, "block_size", int(self.block_size))
        if self.scale == "e8m0":
            if self.scale_mode not in SCALE_MODES:
                raise ValueError(
                    f"Format {self.name!r}: scale_mode must be one of {SCALE_MODES} (torchao's "
                    f"ScaleCalculationMode, lower case); got {self.scale_mode!r}."
                    f"{_closest(str(self.scale_mode).lower(), SCALE_MODES)}"
                )
        else:
            if self.scale_mode is not None:
                raise ValueError(
                    f"Format {self.name!r}: e4m3 scales (NVFP4) have no scale_mode; got "
                    f"{self.scale_mode!r} (pass scale_mode=None)."
                )
            if self.element != "e2m1":
                raise ValueError(
                    f"Format {self.name!r}: e4m3 scales are NVFP4's, whose elements are e2m1; "
                    f"got element {self.element!r}."
                )

    @property
    def dtype(self) -> np.dtype:
        """The element dtype (``float8_e4m3fn``, ``float8_e5m2`` or ``float4_e2m1fn``)."""
        return _ELEMENTS[self.element]

    @property
    def max(self) -> float:
        """The largest finite element value (448, 57344 or 6)."""
        return ELEMENT_LIMITS[self.element][0]

    @property
    def emax(self) -> int:
        """The exponent of the largest power of two the element format holds (8, 15 or 2)."""
        return ELEMENT_LIMITS[self.element][1]

    @property
    def mantissa_bits(self) -> int:
        """Explicit mantissa bits of an element (3, 2 or 1)."""
        return ELEMENT_LIMITS[self.element][2]

    @property
    def packed(self) -> bool:
        """Whether two elements share a byte (e2m1: the first in the low nibble, as torchao)."""
        return self.element == "e2m1"

    def replace(self, **changes: Any) -> Format:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        rule = self.scale_mode if self.scale == "e8m0" else "amax/6"
        return f"{self.name}({self.element}, {self.block_size}x {self.scale} scale, {rule})"


def get_format(name: str | Format, **changes: Any) -> Format:
    """A block-scaled format by name: ``"mxfp8"``, ``"mxfp8_e5m2"``, ``"mxfp4"``, ``"nvfp4"``.

    * ``mxfp8``: float8_e4m3fn elements, one e8m0 scale per 32 (scale mode FLOOR unless
      ``scale_mode=`` says otherwise, as torchao's ``to_mx``).
    * ``mxfp8_e5m2``: float8_e5m2 elements, same scales.
    * ``mxfp4``: float4_e2m1fn elements, packed two per byte, one e8m0 scale per 32.
    * ``nvfp4``: float4_e2m1fn elements, one float8_e4m3fn scale per 16 (and an optional float32
      per-tensor scale, passed to `jaxamp.mx.to_block_scaled`).

    Args:
      name: a name above, or a `Format` (returned with `changes` applied).
      **changes: fields to override, e.g. ``scale_mode="rceil"``.

    Examples:
      >>> import jaxamp.mx
      >>> str(jaxamp.mx.get_format("mxfp8", scale_mode="rceil"))
      'mxfp8(e4m3, 32x e8m0 scale, rceil)'
    """
    if isinstance(name, Format):
        return name.replace(**changes) if changes else name
    if name == "mxfp8":
        base = Format("mxfp8", "e4m3", 32, "e8m0", "floor")
    elif name == "mxfp8_e5m2":
        base = Format("mxfp8_e5m2", "e5m2", 32, "e8m0", "floor")
    elif name == "mxfp4":
        base = Format("mxfp4", "e2m1", 32, "e8m0", "floor")
    elif name == "nvfp4":
        base = Format("nvfp4", "e2m1", 16, "e4m3", None)
    else:
        raise ValueError(
            f"jaxamp.mx.get_format: unknown format {name!r}; valid: {FORMAT_NAMES}."
            f"{_closest(name, FORMAT_NAMES)}"
        )
    return base.replace(**changes) if changes else base
