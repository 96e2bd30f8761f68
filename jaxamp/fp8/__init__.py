"""FP8 training for JAX: torchao's recipes and Flax-compatible delayed scaling, as data."""

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
from jaxamp.fp8._dot import dequantize as dequantize
from jaxamp.fp8._dot import dot_general as dot_general
from jaxamp.fp8._dot import fp8_matmul_hardware as fp8_matmul_hardware
from jaxamp.fp8._dot import fp8_max as fp8_max
from jaxamp.fp8._dot import quantize as quantize
from jaxamp.fp8._dot import quantize_with_scale as quantize_with_scale
from jaxamp.fp8._recipes import RECIPE_NAMES as RECIPE_NAMES
from jaxamp.fp8._recipes import Cast as Cast
from jaxamp.fp8._recipes import Recipe as Recipe
from jaxamp.fp8._recipes import recipe as recipe

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
    "dequantize",
    "dot_general",
    "fp8_matmul_hardware",
    "fp8_max",
    "init_state",
    "quantize",
    "quantize_with_scale",
    "recipe",
    "report",
    "select_state",
]
