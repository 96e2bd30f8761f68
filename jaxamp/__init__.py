"""jaxamp: torch.amp for JAX — mixed-precision policies, dynamic loss scaling, autocast.

The public API is what ``__all__`` lists; ``jaxamp.flax`` (imported as ``jaxamp.flax``) holds the
Flax integration; ``jaxamp.fp8`` holds fp8 training (torchao's recipes, delayed scaling);
``jaxamp.optim_precision`` holds optimizer precision (low-bit state, bf16 masters).

Examples:
  >>> policy = jaxamp.get_policy("bf16-mixed")
  >>> loss_scale = jaxamp.DynamicLossScale.create()
  >>> float(loss_scale.loss_scale)
  65536.0
"""

from jaxamp._autocast import AUTOCAST_CATEGORIES as AUTOCAST_CATEGORIES
from jaxamp._autocast import DtypeRecord as DtypeRecord
from jaxamp._autocast import autocast as autocast
from jaxamp._autocast import autocast_op_list as autocast_op_list
from jaxamp._autocast import autocast_rules as autocast_rules
from jaxamp._autocast import autocast_trace as autocast_trace
from jaxamp._autocast import full_precision as full_precision
from jaxamp._numerics import all_finite as all_finite
from jaxamp.accumulate import MultiStepsState as MultiStepsState
from jaxamp.accumulate import multi_steps as multi_steps
from jaxamp.grad import value_and_grad as value_and_grad
from jaxamp.loss_scale import DynamicLossScale as DynamicLossScale
from jaxamp.loss_scale import LossScale as LossScale
from jaxamp.loss_scale import NoOpLossScale as NoOpLossScale
from jaxamp.loss_scale import StaticLossScale as StaticLossScale
from jaxamp.loss_scaled_state import AmpInfo as AmpInfo
from jaxamp.loss_scaled_state import LossScaledState as LossScaledState
from jaxamp.loss_scaled_state import amp_info as amp_info
from jaxamp.loss_scaled_state import get_loss_scale as get_loss_scale
from jaxamp.loss_scaled_state import loss_scaled_states as loss_scaled_states
from jaxamp.loss_scaled_state import set_loss_scale as set_loss_scale
from jaxamp.optim import LossScaleDivergedError as LossScaleDivergedError
from jaxamp.optim import LossScaledTransformation as LossScaledTransformation
from jaxamp.optim import apply_gradients as apply_gradients
from jaxamp.optim import apply_updates as apply_updates
from jaxamp.optim import loss_scaled as loss_scaled
from jaxamp.optim_precision import KahanSummationState as KahanSummationState
from jaxamp.optim_precision import LowPrecisionState as LowPrecisionState
from jaxamp.optim_precision import StochasticRoundingState as StochasticRoundingState
from jaxamp.optim_precision import kahan_summation as kahan_summation
from jaxamp.optim_precision import low_precision_state as low_precision_state
from jaxamp.optim_precision import stochastic_round as stochastic_round
from jaxamp.optim_precision import stochastic_rounding as stochastic_rounding
from jaxamp.policy import Policy as Policy
from jaxamp.policy import cast_floating as cast_floating
from jaxamp.policy import get_policy as get_policy

__version__ = "0.1.0"

__all__ = [
    "AUTOCAST_CATEGORIES",
    "AmpInfo",
    "DtypeRecord",
    "DynamicLossScale",
    "KahanSummationState",
    "LossScale",
    "LossScaleDivergedError",
    "LossScaledState",
    "LossScaledTransformation",
    "LowPrecisionState",
    "MultiStepsState",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "StochasticRoundingState",
    "all_finite",
    "amp_info",
    "apply_gradients",
    "apply_updates",
    "autocast",
    "autocast_op_list",
    "autocast_rules",
    "autocast_trace",
    "cast_floating",
    "full_precision",
    "get_loss_scale",
    "get_policy",
    "kahan_summation",
    "loss_scaled",
    "loss_scaled_states",
    "low_precision_state",
    "multi_steps",
    "set_loss_scale",
    "stochastic_round",
    "stochastic_rounding",
    "value_and_grad",
]


# Names removed from the API, with what replaces each: `jaxamp.<old>` says what to call instead.
_REMOVED = {
    "amp_states": "jaxamp.loss_scaled_states(opt_state), which returns the same dict of "
    "LossScaledState by path",
}


def __getattr__(name: str):
    if name in _REMOVED:
        raise AttributeError(f"jaxamp.{name} was removed: call {_REMOVED[name]}.", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)


def __dir__() -> list[str]:
    # The namespace users see is the API: submodules (jaxamp.policy, jaxamp.optim, ...) stay
    # importable by name but are not listed next to it.
    return sorted([*__all__, "__version__"])
