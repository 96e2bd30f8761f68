"""Per-module mixed precision for unmodified linen models, through `nn.intercept_methods`.

Every intercepted method call of every module runs under that module's effective policy
(see `jaxamp.flax._rules` for the precedence):

* params the module creates with ``self.param`` are initialised, then cast to the param dtype
  (that is what `init` stores); when read they are cast to the compute dtype;
* floating positional and keyword arguments are cast to the compute dtype;
* floating outputs are cast to the output dtype (the caller's compute dtype for inner modules,
  the global output dtype for the root).

Flax's own layers with ``dtype=None`` (the default) then compute in the compute dtype, and a
user module that never heard of dtypes does too. The casts are differentiable, so float32
params get float32 gradients.

Limits: params read other than through ``self.param`` (e.g. ``self.variables``) are not cast;
``@nn.nowrap`` and private (``_name``) methods are not intercepted (they run inside their
caller's policy); non-param variables (e.g. BatchNorm statistics) are left alone.

Examples:
  >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2)])
  >>> apply = jf.linen.with_policy(model.apply, "bf16-mixed")
  >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  >>> jax.jit(apply)(variables, jnp.ones((1, 3))).dtype
  dtype('float32')
  >>> nn.LayerNorm in jf.linen.DEFAULT_RULES  # normalisation layers compute in float32
  True
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxamp._policy import Policy, cast_floating
from jaxamp.flax import _rules
from jaxamp.flax._attention import float32_softmax_attention

__all__ = [
    "DEFAULT_RULES",
    "current_policy",
    "intercept",
    "policy_interceptor",
    "with_policy",
]

_F32 = np.dtype(jnp.float32)

#: Normalisation layers compute in float32 by default (torch on CUDA does the same).
DEFAULT_RULES = {
    nn.BatchNorm: _rules.float32_compute,
    nn.LayerNorm: _rules.float32_compute,
    nn.RMSNorm: _rules.float32_compute,
    nn.GroupNorm: _rules.float32_compute,
    nn.InstanceNorm: _rules.float32_compute,
}

_local = threading.local()


def _stack() -> list[Policy]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_policy() -> Policy | None:
    """The effective policy of the innermost linen module now running under `with_policy` (or
    `policy_interceptor`), or None outside one.

    Examples:
      >>> class Probe(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         self.sow("intermediates", "policy", str(jf.linen.current_policy()))
      ...         return x
      >>> apply = jf.linen.with_policy(Probe().apply, "bf16-mixed")
      >>> _, state = apply({}, jnp.ones(2), mutable=["intermediates"])
      >>> state["intermediates"]["policy"]
      ('p=f32,c=bf16,o=f32',)
      >>> jf.linen.current_policy() is None
      True
    """
    stack = _stack()
    return stack[-1] if stack else None


_MISSING = object()


def _param_method(module: nn.Module, policy: Policy) -> Callable[..., Any]:
    base = type(module).param

    @functools.wraps(base)
    def param(name, init_fn, *init_args, unbox=True, **init_kwargs):
        def init_in_param_dtype(*args, **kwargs):
            return cast_floating(init_fn(*args, **kwargs), policy.param_dtype)

        value = base(module, name, init_in_param_dtype, *init_args, unbox=unbox, **init_kwargs)
        return cast_floating(value, policy.compute_dtype)

    return param


@contextlib.contextmanager
def _instance_override(module: nn.Module, name: str, value: Any) -> Iterator[None]:
    # Linen modules are frozen dataclasses; the override lives in the instance dict for the
    # duration of one call and is then removed (nested calls restore what they found).
    previous = module.__dict__.get(name, _MISSING)
    object.__setattr__(module, name, value)
    try:
        yield
    finally:
        if previous is _MISSING:
            del module.__dict__[name]
        else:
            object.__setattr__(module, name, previous)


def _module_path(module: nn.Module) -> str:
    try:
        return _rules.path_string(module.path)
    except Exception:  # unbound module: no scope, no path
        return ""


class _Config:
    def __init__(self, policy, rules, defaults, float32_softmax):
        self.policy = _rules.check_policy(policy)
        self.user_rules = _rules.normalize_rules(rules)
        self.default_rules = _rules.normalize_rules(DEFAULT_RULES) if defaults else ()
        self.float32_softmax = bool(float32_softmax)
        # Rules seen to match a module, and what was seen, for the unmatched-rule warning.
        self.matched: set[int] = set()
        self.paths: set[str] = set()
        self.classes: set[type] = set()
        self.checked = False

    def effective(self, module: nn.Module, caller: Policy | None) -> Policy:
        path = _module_path(module)
        if not self.checked:
            self.paths.add(path)
            self.classes.add(type(module))
            for rule in self.user_rules:
                if rule.order not in self.matched and _rules.rule_matches(rule, module, path):
                    self.matched.add(rule.order)
        rule = _rules.match(self.user_rules, self.default_rules, module, path)
        if caller is None:
            return _rules.root_rule_policy(rule, self.policy)
        return _rules.resolve(rule, caller, caller.compute_dtype, is_root=False)


def _wants_float32_softmax(config: _Config, module: nn.Module, policy: Policy) -> bool:
    return (
        config.float32_softmax
        and isinstance(module, nn.MultiHeadDotProductAttention)
        and module.attention_fn is nn.dot_product_attention
        and policy.compute_dtype != _F32
    )


def policy_interceptor(
    policy: Any,
    rules: _rules.Rules = None,
    *,
    defaults: bool = True,
    float32_softmax: bool = True,
) -> Callable[..., Any]:
    """Returns a linen method interceptor applying per-module policies.

    Use `intercept` (a context manager) or `with_policy` (a function wrapper) unless you
    compose interceptors yourself with `nn.intercept_methods`.

    Args:
      policy: the global policy (anything `jaxamp.get_policy` accepts), used by the root.
      rules: per-module rules ``{matcher: policy or override(...)}``; see the module docs for
        matchers and precedence.
      defaults: apply `DEFAULT_RULES` (normalisation layers in float32) below user rules.
      float32_softmax: run the softmax of `nn.MultiHeadDotProductAttention` (with Flax's default
        `attention_fn`) in float32 while its matmuls run in the compute dtype.

    Returns:
      An interceptor ``(next_fun, args, kwargs, context) -> output``.

    Examples:
      >>> model, x = nn.Dense(2), jnp.ones((1, 3))
      >>> interceptor = jf.linen.policy_interceptor("bf16-true")
      >>> with nn.intercept_methods(interceptor):
      ...     variables = model.init(jax.random.key(0), x)
      >>> variables["params"]["kernel"].dtype
      dtype(bfloat16)
    """
    config = _Config(policy, rules, defaults, float32_softmax)

    def interceptor(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        stack = _stack()
        caller = stack[-1] if stack else None
        effective = config.effective(module, caller)
        if method == "setup":
            # setup runs before the method that triggered it: only param creation matters.
            with _instance_override(module, "param", _param_method(module, effective)):
                return next_fun(*args, **kwargs)
        if method.startswith("_") and method != "__call__":
            return next_fun(*args, **kwargs)
        args, kwargs = cast_floating((args, kwargs), effective.compute_dtype)
        with contextlib.ExitStack() as overrides:
            overrides.enter_context(
                _instance_override(module, "param", _param_method(module, effective))
            )
            if _wants_float32_softmax(config, module, effective):
                overrides.enter_context(
                    _instance_override(module, "attention_fn", float32_softmax_attention)
                )
            stack.append(effective)
            try:
                out = next_fun(*args, **kwargs)
            finally:
                stack.pop()
        if caller is None and not config.checked:
            # The first complete root call has shown every module: warn about dead rules once.
            config.checked = True
            _rules.warn_unmatched(config.user_rules, config.matched, config.paths, config.classes)
        return cast_floating(out, effective.output_dtype)

    interceptor.config = config  # for the precision report
    return interceptor


def intercept(
    policy: Any,
    rules: _rules.Rules = None,
    *,
    defaults: bool = True,
    float32_softmax: bool = True,
) -> contextlib.AbstractContextManager[None]:
    """Context manager: linen modules called inside it run under per-module policies.

    Args: as `policy_interceptor`.

    Examples:
      >>> model, x = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)]), jnp.ones((1, 3))
      >>> with jf.linen.intercept("bf16-mixed", {"layers_2": "fp32"}):
      ...     variables = model.init(jax.random.key(0), x)  # params stored in float32
      ...     logits = model.apply(variables, x)  # bf16 compute, last Dense in fp32
      >>> variables["params"]["layers_0"]["kernel"].dtype, logits.dtype
      (dtype('float32'), dtype('float32'))
    """
    return nn.intercept_methods(
        policy_interceptor(policy, rules, defaults=defaults, float32_softmax=float32_softmax)
    )


def with_policy(
    fn: Callable[..., Any],
    policy: Any,
    rules: _rules.Rules = None,
    *,
    defaults: bool = True,
    float32_softmax: bool = True,
) -> Callable[..., Any]:
    """Wraps `fn` (e.g. ``model.init`` or ``model.apply``) to run under per-module policies.

    The interception happens when `fn` runs (or is traced, under `jit`), so the wrapper can be
    jitted, differentiated and passed as a `TrainState`'s ``apply_fn``.

    Args:
      fn: the function to wrap.
      policy, rules, defaults, float32_softmax: as `policy_interceptor`.

    Returns:
      A function with `fn`'s signature; its ``policy`` attribute holds the global policy and
      ``interceptor`` the interceptor.

    Examples:
      >>> model, x = nn.Dense(2), jnp.ones((1, 3))
      >>> init = jf.linen.with_policy(model.init, "bf16-mixed")
      >>> apply = jf.linen.with_policy(model.apply, "p=f32,c=bf16,o=bf16")
      >>> variables = init(jax.random.key(0), x)
      >>> variables["params"]["kernel"].dtype, jax.jit(apply)(variables, x).dtype
      (dtype('float32'), dtype(bfloat16))

      Normalisation layers compute in float32 by default (`DEFAULT_RULES`);
      ``defaults=False`` turns that off.
    """
    if not callable(fn):
        raise TypeError(f"with_policy(fn=...) takes a callable; got {type(fn).__name__}.")
    interceptor = policy_interceptor(
        policy, rules, defaults=defaults, float32_softmax=float32_softmax
    )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with nn.intercept_methods(interceptor):
            return fn(*args, **kwargs)

    wrapped.policy = interceptor.config.policy
    wrapped.interceptor = interceptor
    wrapped.__wrapped_fn__ = fn
    return wrapped
