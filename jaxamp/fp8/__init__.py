"""FP8 training for JAX: torchao's recipes and Flax-compatible delayed scaling, as data."""

from jaxamp import _deprecation
from jaxamp.fp8._convert import MatmulInfo as MatmulInfo
from jaxamp.fp8._convert import MatmulOperands as MatmulOperands
from jaxamp.fp8._convert import MatmulRecord as MatmulRecord
from jaxamp.fp8._convert import capture_operands as capture_operands
from jaxamp.fp8._convert import combine_states as combine_states
from jaxamp.fp8._convert import convert as convert
from jaxamp.fp8._convert import init_state as init_state
from jaxamp.fp8._convert import report as report
from jaxamp.fp8._convert import select_state as select_state
from jaxamp.fp8._dot import DelayedScalingState as DelayedScalingState
from jaxamp.fp8._dot import amax_to_scale as amax_to_scale
from jaxamp.fp8._dot import check_hardware as check_hardware
from jaxamp.fp8._dot import dot_general as dot_general
from jaxamp.fp8._dot import fp8_matmul_hardware as fp8_matmul_hardware
from jaxamp.fp8._dot import fp8_max as fp8_max
from jaxamp.fp8._dot import from_fp8 as from_fp8
from jaxamp.fp8._dot import to_fp8 as to_fp8
from jaxamp.fp8._dot import to_fp8_dynamic as to_fp8_dynamic
from jaxamp.fp8._recipes import RECIPE_NAMES as RECIPE_NAMES
from jaxamp.fp8._recipes import Cast as Cast
from jaxamp.fp8._recipes import Recipe as Recipe
from jaxamp.fp8._recipes import get_recipe as get_recipe

__all__ = [
    "RECIPE_NAMES",
    "Cast",
    "DelayedScalingState",
    "MatmulInfo",
    "MatmulOperands",
    "MatmulRecord",
    "Recipe",
    "amax_to_scale",
    "capture_operands",
    "check_hardware",
    "combine_states",
    "convert",
    "dot_general",
    "fp8_matmul_hardware",
    "fp8_max",
    "from_fp8",
    "get_recipe",
    "init_state",
    "report",
    "select_state",
    "to_fp8",
    "to_fp8_dynamic",
]


def __getattr__(name: str):
    # Old names (quantize, quantize_with_scale, dequantize, recipe): one release with a warning.
    return _deprecation.package_getattr(__name__, name)
