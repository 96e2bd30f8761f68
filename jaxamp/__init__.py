"""jaxamp: torch.amp for JAX — mixed-precision policies, dynamic loss scaling, autocast.

The public API is what ``__all__`` lists, each name at this one address; the modules that define
them are private. The subpackages are namespaces of their own, imported by name:
``jaxamp.flax`` (the Flax integration), ``jaxamp.fp8`` (fp8 training: torchao's recipes, delayed
scaling), ``jaxamp.optim_precision`` (optimizer precision: low-bit state, bf16 weights without
float32 masters) and ``jaxamp.mx`` (block-scaled formats).

Examples:
  >>> policy = jaxamp.get_policy("bf16-mixed")
  >>> loss_scale = jaxamp.DynamicLossScale.create()
  >>> float(loss_scale.loss_scale)
  65536.0
"""

from jaxamp import _deprecation
from jaxamp import optim_precision as optim_precision  # loads with jaxamp, as jaxamp.fp8 does
from jaxamp._accumulate import MultiStepsState as MultiStepsState
from jaxamp._accumulate import multi_steps as multi_steps
from jaxamp._autocast import AUTOCAST_CATEGORIES as AUTOCAST_CATEGORIES
from jaxamp._autocast import DtypeRecord as DtypeRecord
from jaxamp._autocast import autocast as autocast
from jaxamp._autocast import autocast_op_list as autocast_op_list
from jaxamp._autocast import autocast_rules as autocast_rules
from jaxamp._autocast import autocast_trace as autocast_trace
from jaxamp._autocast import full_precision as full_precision
from jaxamp._grad import value_and_grad as value_and_grad
from jaxamp._loss_scale import DynamicLossScale as DynamicLossScale
from jaxamp._loss_scale import LossScale as LossScale
from jaxamp._loss_scale import NoOpLossScale as NoOpLossScale
from jaxamp._loss_scale import StaticLossScale as StaticLossScale
from jaxamp._loss_scale import default_loss_scale as default_loss_scale
from jaxamp._loss_scaled_state import AmpInfo as AmpInfo
from jaxamp._loss_scaled_state import LossScaledState as LossScaledState
from jaxamp._loss_scaled_state import amp_info as amp_info
from jaxamp._loss_scaled_state import get_loss_scale as get_loss_scale
from jaxamp._loss_scaled_state import loss_scaled_states as loss_scaled_states
from jaxamp._loss_scaled_state import set_loss_scale as set_loss_scale
from jaxamp._numerics import all_finite as all_finite
from jaxamp._optim import LossScaleDivergedError as LossScaleDivergedError
from jaxamp._optim import LossScaledTransformation as LossScaledTransformation
from jaxamp._optim import apply_gradients as apply_gradients
from jaxamp._optim import apply_updates as apply_updates
from jaxamp._optim import loss_scaled as loss_scaled
from jaxamp._policy import Policy as Policy
from jaxamp._policy import cast_floating as cast_floating
from jaxamp._policy import get_policy as get_policy
from jaxamp._policy import parse_dtype as parse_dtype

_deprecation.install()  # the old module addresses (jaxamp.policy, ...), one release

__version__ = "0.1.0"

__all__ = [
    "AUTOCAST_CATEGORIES",
    "AmpInfo",
    "DtypeRecord",
    "DynamicLossScale",
    "LossScale",
    "LossScaleDivergedError",
    "LossScaledState",
    "LossScaledTransformation",
    "MultiStepsState",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "amp_info",
    "apply_gradients",
    "apply_updates",
    "autocast",
    "autocast_op_list",
    "autocast_rules",
    "autocast_trace",
    "cast_floating",
    "default_loss_scale",
    "full_precision",
    "get_loss_scale",
    "get_policy",
    "loss_scaled",
    "loss_scaled_states",
    "multi_steps",
    "parse_dtype",
    "set_loss_scale",
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
    # Old addresses (jaxamp.policy, jaxamp.kahan_summation, ...): one release with a warning.
    return _deprecation.package_getattr(__name__, name)


def __dir__() -> list[str]:
    # The namespace users see is the API: the subpackages (jaxamp.flax, jaxamp.fp8, ...) are
    # imported by name and not listed next to it.
    return sorted([*__all__, "__version__"])
