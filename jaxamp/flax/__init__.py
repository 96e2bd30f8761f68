"""Flax integration: per-module mixed-precision policies for linen and NNX, train-state glue,
checkpoints and a precision report.

Import as ``import jaxamp.flax as jf``.

Per-module rules (``rules={matcher: policy}``) — matchers: a module class, a path glob (``str``,
``fnmatch`` on the "/"-joined path), a compiled regex (``re.search`` on the path) or a predicate
``(module, path) -> bool``; values: a policy (anything `jaxamp.get_policy` accepts, used as is)
or `override(param=, compute=, output=)` (changes the inherited dtypes). Precedence for a module:

1. instance rules (glob, regex, predicate) that match it: the last one given wins;
2. class rules that match it: the most derived class wins (the last one given for ties);
3. default rules: normalisation layers (BatchNorm, LayerNorm, RMSNorm, GroupNorm, InstanceNorm)
   compute in float32 (``defaults=False`` turns them off);
4. otherwise the module inherits its parent's param and compute dtypes.

Inner modules return outputs in their parent's compute dtype (unless their rule is a full policy,
or an override with ``output=``); the root returns the global policy's output dtype. Attention
softmax runs in float32 (``float32_softmax=True``) for Flax's attention modules.

Examples:
  linen:

  >>> model, x = nn.Dense(2), jnp.ones((1, 3))
  >>> init = jf.linen.with_policy(model.init, "bf16-mixed")
  >>> state = jf.TrainState.create(
  ...     apply_fn=model.apply, params=init(jax.random.key(0), x)["params"],
  ...     tx=optax.adam(1e-3), policy="bf16-mixed",
  ... )

  NNX:

  >>> model = jf.nnx.apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "bf16-mixed")
  >>> optimizer = jf.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param, policy="bf16-mixed")
"""

from jaxamp import _deprecation
from jaxamp.flax import checkpoint as checkpoint
from jaxamp.flax import linen as linen
from jaxamp.flax import nnx as nnx
from jaxamp.flax._attention import float32_softmax_attention as float32_softmax_attention
from jaxamp.flax._nnx_optimizer import Optimizer as Optimizer
from jaxamp.flax._nnx_optimizer import nnx_value_and_grad as nnx_value_and_grad
from jaxamp.flax._report import ModuleReport as ModuleReport
from jaxamp.flax._report import PrecisionReport as PrecisionReport
from jaxamp.flax._report import precision_report as precision_report
from jaxamp.flax._rules import PolicyOverride as PolicyOverride
from jaxamp.flax._rules import UnmatchedRuleWarning as UnmatchedRuleWarning
from jaxamp.flax._rules import float32_compute as float32_compute
from jaxamp.flax._rules import override as override
from jaxamp.flax._train_state import TrainState as TrainState

__all__ = [
    "ModuleReport",
    "Optimizer",
    "PolicyOverride",
    "PrecisionReport",
    "TrainState",
    "UnmatchedRuleWarning",
    "checkpoint",
    "float32_compute",
    "float32_softmax_attention",
    "linen",
    "nnx",
    "nnx_value_and_grad",
    "override",
    "precision_report",
]


def __getattr__(name: str):
    # Old addresses (jaxamp.flax.train_state, jaxamp.flax.default_loss_scale, ...): one release
    # with a warning.
    return _deprecation.package_getattr(__name__, name)
