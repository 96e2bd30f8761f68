"""Block-scaled training formats for JAX: MXFP8, MXFP4 and NVFP4, bit-exact to torchao."""

from jaxamp.mx._formats import FORMAT_NAMES as FORMAT_NAMES
from jaxamp.mx._formats import SCALE_MODES as SCALE_MODES
from jaxamp.mx._formats import Format as Format
from jaxamp.mx._formats import format as format  # noqa: A004
from jaxamp.mx._quantize import dequantize as dequantize
from jaxamp.mx._quantize import per_tensor_scale as per_tensor_scale
from jaxamp.mx._quantize import quantize as quantize
from jaxamp.mx._quantize import scales_to_float32 as scales_to_float32

__all__ = [
    "FORMAT_NAMES",
    "SCALE_MODES",
    "Format",
    "dequantize",
    "format",
    "per_tensor_scale",
    "quantize",
    "scales_to_float32",
]
