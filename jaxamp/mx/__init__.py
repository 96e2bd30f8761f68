"""Block-scaled training formats for JAX: MXFP8, MXFP4 and NVFP4, bit-exact to torchao."""

from jaxamp import _deprecation
from jaxamp.mx._convert import capture_operands as capture_operands
from jaxamp.mx._convert import convert as convert
from jaxamp.mx._convert import report as report
from jaxamp.mx._formats import FORMAT_NAMES as FORMAT_NAMES
from jaxamp.mx._formats import SCALE_MODES as SCALE_MODES
from jaxamp.mx._formats import Format as Format
from jaxamp.mx._formats import get_format as get_format
from jaxamp.mx._linear import check_hardware as check_hardware
from jaxamp.mx._linear import dot_general as dot_general
from jaxamp.mx._linear import mx_matmul_hardware as mx_matmul_hardware
from jaxamp.mx._quantize import from_block_scaled as from_block_scaled
from jaxamp.mx._quantize import per_tensor_scale as per_tensor_scale
from jaxamp.mx._quantize import scales_to_float32 as scales_to_float32
from jaxamp.mx._quantize import to_block_scaled as to_block_scaled
from jaxamp.mx._recipes import RECIPE_NAMES as RECIPE_NAMES
from jaxamp.mx._recipes import Recipe as Recipe
from jaxamp.mx._recipes import get_recipe as get_recipe

__all__ = [
    "FORMAT_NAMES",
    "RECIPE_NAMES",
    "SCALE_MODES",
    "Format",
    "Recipe",
    "capture_operands",
    "check_hardware",
    "convert",
    "dot_general",
    "from_block_scaled",
    "get_format",
    "get_recipe",
    "mx_matmul_hardware",
    "per_tensor_scale",
    "report",
    "scales_to_float32",
    "to_block_scaled",
]


def __getattr__(name: str):
    # Old names (format, recipe, quantize, dequantize): one release with a warning.
    return _deprecation.package_getattr(__name__, name)
