"""Optimizer precision: optimizer state in bf16, fp8 or 8-/4-bit block-wise codes (torchao's
schemes, bit-identical codes), and bf16 parameters without float32 masters that still learn
(stochastic rounding, Kahan summation). All are optax wrappers that compose with
`jaxamp.loss_scaled` and `jaxamp.multi_steps`."""

from jaxamp import _deprecation
from jaxamp.optim_precision._codecs import STATE_FORMATS as STATE_FORMATS
from jaxamp.optim_precision._codecs import BlockOrder as BlockOrder
from jaxamp.optim_precision._codecs import QuantizedArray as QuantizedArray
from jaxamp.optim_precision._codecs import decode_blockwise as decode_blockwise
from jaxamp.optim_precision._codecs import encode_blockwise as encode_blockwise
from jaxamp.optim_precision._masters import PRESETS as PRESETS
from jaxamp.optim_precision._masters import KahanSummationState as KahanSummationState
from jaxamp.optim_precision._masters import StochasticRoundingState as StochasticRoundingState
from jaxamp.optim_precision._masters import kahan_summation as kahan_summation
from jaxamp.optim_precision._masters import preset as preset
from jaxamp.optim_precision._masters import stochastic_round as stochastic_round
from jaxamp.optim_precision._masters import stochastic_rounding as stochastic_rounding
from jaxamp.optim_precision._state import LowPrecisionState as LowPrecisionState
from jaxamp.optim_precision._state import adamw_4bit as adamw_4bit
from jaxamp.optim_precision._state import adamw_8bit as adamw_8bit
from jaxamp.optim_precision._state import adamw_fp8 as adamw_fp8
from jaxamp.optim_precision._state import low_precision_state as low_precision_state
from jaxamp.optim_precision._state import state_bytes as state_bytes

__all__ = [
    "PRESETS",
    "STATE_FORMATS",
    "BlockOrder",
    "KahanSummationState",
    "LowPrecisionState",
    "QuantizedArray",
    "StochasticRoundingState",
    "adamw_4bit",
    "adamw_8bit",
    "adamw_fp8",
    "decode_blockwise",
    "encode_blockwise",
    "kahan_summation",
    "low_precision_state",
    "preset",
    "state_bytes",
    "stochastic_round",
    "stochastic_rounding",
]


def __getattr__(name: str):
    # Old names (quantize, dequantize): one release with a warning.
    return _deprecation.package_getattr(__name__, name)
