"""Per-module mixed precision for unmodified NNX models.

`apply_policy(model, policy, rules)` resolves every submodule's effective policy once, from the
module tree (see `jaxamp.flax._rules` for the precedence; paths are "/"-joined attribute names
and indices, e.g. ``"blocks/0/attn"``), and then, in place:

* casts every `nnx.Param` to its module's param dtype (NNX creates params eagerly, so they are
  cast after construction);
* makes each module's ``__call__`` cast floating arguments to its compute dtype, read its params
  in its compute dtype (restored afterwards: the stored params keep the param dtype, and the
  casts are differentiable, so float32 params get float32 gradients), and cast floating outputs
  to its output dtype (the parent's compute dtype for inner modules, the global output dtype for
  the root);
* gives `nnx.MultiHeadAttention` modules that use Flax's default attention function a float32
  softmax (``float32_softmax=True``).

The call hook is installed by giving each instance a subclass of its own class (same name,
``isinstance`` unchanged), so it survives `nnx.split`/`nnx.merge`, `nnx.jit` and `nnx.grad`.
Only ``__call__`` is hooked; params read by other methods (e.g. `nnx.Embed.attend`) are cast
when an enclosing module's ``__call__`` runs.

Examples:
  >>> rngs = nnx.Rngs(0)
  >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.LayerNorm(4, rngs=rngs))
  >>> _ = jf.nnx.apply_policy(model, "bf16-mixed")
  >>> model(jnp.ones((1, 3))).dtype
  dtype('float32')
  >>> nnx.LayerNorm in jf.nnx.DEFAULT_RULES  # normalisation layers compute in float32
  True
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxamp._policy import Policy, cast_floating
from jaxamp.flax import _rules
from jaxamp.flax._attention import float32_softmax_attention

__all__ = [
    "DEFAULT_RULES",
    "apply_policy",
    "has_own_call",
    "module_policies",
    "module_policy",
    "own_params",
    "remove_policy",
]

_F32 = np.dtype(jnp.float32)
_POLICY_ATTR = "_jaxamp_policy"
_RULE_ATTR = "_jaxamp_rule"

#: Normalisation layers compute in float32 by default (torch on CUDA does the same).
DEFAULT_RULES = {
    nnx.BatchNorm: _rules.float32_compute,
    nnx.LayerNorm: _rules.float32_compute,
    nnx.RMSNorm: _rules.float32_compute,
    nnx.GroupNorm: _rules.float32_compute,
    nnx.InstanceNorm: _rules.float32_compute,
}

_local = threading.local()


def _swapped() -> dict[int, tuple[nnx.Param, Any]]:
    if not hasattr(_local, "swapped"):
        _local.swapped = {}
    return _local.swapped


def own_params(module: nnx.Module) -> Iterator[nnx.Param]:
    """The `nnx.Param`s `module` holds itself (attributes, lists, dicts), not its submodules'.

    Examples:
      >>> [p.get_value().shape for p in jf.nnx.own_params(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))]
      [(3, 2), (2,)]
    """
    for value in vars(module).values():
        if isinstance(value, nnx.Param):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, nnx.Param))
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, nnx.Param))


def _cast_subtree_params(module: nnx.Module) -> list[int]:
    """Casts the params under `module` to their owners' compute dtypes; returns what it did."""
    swapped = _swapped()
    done = []
    for _, sub in nnx.iter_modules(module):
        policy = getattr(sub, _POLICY_ATTR, None)
        if policy is None:
            continue
        for param in own_params(sub):
            if id(param) in swapped:
                continue
            original = param.get_value()
            swapped[id(param)] = (param, original)
            done.append(id(param))
            param.set_value(cast_floating(original, policy.compute_dtype))
    return done


def _restore(ids: list[int]) -> None:
    swapped = _swapped()
    for key in ids:
        param, original = swapped.pop(key)
        param.set_value(original)


def _make_amp_call(base: type):
    @functools.wraps(base.__call__)
    def __call__(self, *args, **kwargs):
        policy: Policy = getattr(self, _POLICY_ATTR)
        casted = _cast_subtree_params(self)
        try:
            args, kwargs = cast_floating((args, kwargs), policy.compute_dtype)
            out = type(self).__jaxamp_base__.__call__(self, *args, **kwargs)
        finally:
            _restore(casted)
        return cast_floating(out, policy.output_dtype)

    return __call__


@functools.cache
def _amp_class(cls: type) -> type:
    if getattr(cls, "__jaxamp_base__", None) is not None:
        return cls
    return type(
        cls.__name__,
        (cls,),
        {
            "__call__": _make_amp_call(cls),
            "__jaxamp_base__": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        },
    )


def _base_class(module: Any) -> type:
    return getattr(type(module), "__jaxamp_base__", None) or type(module)


def _ordered_modules(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    seen, out = set(), []
    for path, module in nnx.iter_modules(model):
        if id(module) in seen:  # a shared module takes the policy of its first path
            continue
        seen.add(id(module))
        out.append((tuple(path), module))
    out.sort(key=lambda item: len(item[0]))
    return out


class _Resolved:
    """Effective policies and the rules that produced them, by module path."""

    def __init__(self):
        self.policies: dict[tuple, Policy] = {}
        self.sources: dict[tuple, str] = {}


def _resolve_tree(
    model: nnx.Module, policy: Policy, rules: _rules.Rules, defaults: bool
) -> tuple[list[tuple[tuple, nnx.Module]], _Resolved]:
    user_rules = _rules.normalize_rules(rules)
    default_rules = _rules.normalize_rules(DEFAULT_RULES) if defaults else ()
    modules = _ordered_modules(model)
    resolved = _Resolved()
    for path, module in modules:
        # Match against the user's class, not the hook subclass.
        rule = _rules.match(
            user_rules, default_rules, module, _rules.path_string(path), _base_class(module)
        )
        if not path:
            effective = _rules.root_rule_policy(rule, policy)
        else:
            parent = resolved.policies[_parent_path(path, resolved.policies)]
            effective = _rules.resolve(rule, parent, parent.compute_dtype, is_root=False)
        resolved.policies[path] = effective
        resolved.sources[path] = _rules.describe_rule(rule, rule in default_rules)
    _rules.warn_unmatched(
        user_rules,
        {
            r.order
            for r in user_rules
            for path, module in modules
            if _rules.rule_matches(r, module, _rules.path_string(path), _base_class(module))
        },
        (_rules.path_string(path) for path, _ in modules),
        (_base_class(module) for _, module in modules),
    )
    return modules, resolved


def _parent_path(path: tuple, known: dict[tuple, Any]) -> tuple:
    for cut in range(len(path) - 1, -1, -1):
        if path[:cut] in known:
            return path[:cut]
    return ()


def apply_policy(
    model: nnx.Module,
    policy: Any,
    rules: _rules.Rules = None,
    *,
    defaults: bool = True,
    float32_softmax: bool = True,
) -> nnx.Module:
    """Turns on per-module mixed precision for an NNX model, in place.

    Call it outside of transforms (before `nnx.jit`, `nnx.Optimizer`). Calling it again
    replaces the previous policies.

    Args:
      model: the NNX module (its submodules are found with `nnx.iter_modules`).
      policy: the global policy (anything `jaxamp.get_policy` accepts), used by the root.
      rules: per-module rules ``{matcher: policy or override(...)}``: matchers are module
        classes, path globs (``"blocks/*/mlp"``), compiled regexes or predicates
        ``(module, path) -> bool``. See `jaxamp.flax` for precedence.
      defaults: apply `DEFAULT_RULES` (normalisation layers in float32) below user rules.
      float32_softmax: give `nnx.MultiHeadAttention` modules that use Flax's default
        `attention_fn` a float32 softmax (matmuls stay in the compute dtype).

    Returns:
      `model` itself (modified in place).

    Raises:
      TypeError: `model` is not an `nnx.Module`, or a rule is malformed.

    Examples:
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs))
      >>> model = jf.nnx.apply_policy(model, "bf16-mixed", {"layers/1": "fp32"})
      >>> policies = jf.nnx.module_policies(model)
      >>> str(policies["layers/0"]), str(policies["layers/1"])
      ('p=f32,c=bf16,o=bf16', 'p=f32,c=f32,o=f32')
      >>> model(jnp.ones((1, 3))).dtype  # bf16 compute, f32 last layer, f32 output
      dtype('float32')
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"apply_policy(model=...) takes an nnx.Module; got {type(model).__name__}.")
    policy = _rules.check_policy(policy)
    modules, resolved = _resolve_tree(model, policy, rules, defaults)
    for path, module in modules:
        effective = resolved.policies[path]
        for param in own_params(module):
            param.set_value(cast_floating(param.get_value(), effective.param_dtype))
        setattr(module, _POLICY_ATTR, effective)
        setattr(module, _RULE_ATTR, resolved.sources[path])
        if (
            float32_softmax
            and isinstance(module, nnx.MultiHeadAttention)
            and module.attention_fn is nnx.dot_product_attention
            and effective.compute_dtype != _F32
        ):
            module.attention_fn = float32_softmax_attention
        if has_own_call(type(module)):
            module.__class__ = _amp_class(type(module))
    return model


def has_own_call(cls: type) -> bool:
    """Whether a module class defines ``__call__`` (itself or a base other than `object`):
    the classes `apply_policy` hooks. Containers such as ``nnx.List`` have none.

    Examples:
      >>> jf.nnx.has_own_call(nnx.Linear), jf.nnx.has_own_call(nnx.Module)
      (True, False)
    """
    return any("__call__" in vars(base) for base in cls.__mro__ if base is not object)


def remove_policy(model: nnx.Module) -> nnx.Module:
    """Removes the call hooks `apply_policy` installed (params keep their current dtypes).

    Examples:
      >>> model = jf.nnx.apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "bf16-true")
      >>> model(jnp.ones((1, 3))).dtype
      dtype(bfloat16)
      >>> model = jf.nnx.remove_policy(model)
      >>> jf.nnx.module_policies(model), model.kernel[...].dtype
      ({}, dtype(bfloat16))
    """
    for _, module in _ordered_modules(model):
        base = getattr(type(module), "__jaxamp_base__", None)
        if base is not None:
            module.__class__ = base
        for attr in (_POLICY_ATTR, _RULE_ATTR):
            if attr in vars(module):
                delattr(module, attr)
        if getattr(module, "attention_fn", None) is float32_softmax_attention:
            module.attention_fn = nnx.dot_product_attention
    return model


def module_policy(module: nnx.Module) -> tuple[Policy | None, str | None]:
    """The policy `apply_policy` gave `module` itself and the rule that chose it, or
    ``(None, None)`` for a module it did not configure.

    Examples:
      >>> model = jf.nnx.apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "bf16-mixed")
      >>> policy, rule = jf.nnx.module_policy(model)
      >>> str(policy), rule
      ('p=f32,c=bf16,o=f32', 'inherited')
    """
    return vars(module).get(_POLICY_ATTR), vars(module).get(_RULE_ATTR)


def module_policies(model: nnx.Module) -> dict[str, Policy]:
    """The effective policy of every module `apply_policy` configured, keyed by path.

    Examples:
      >>> model = jf.nnx.apply_policy(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "fp16-mixed")
      >>> jf.nnx.module_policies(model)
      {'': Policy('p=f32,c=f16,o=f32')}
    """
    out = {}
    for path, module in _ordered_modules(model):
        policy = vars(module).get(_POLICY_ATTR)
        if policy is not None:
            out[_rules.path_string(path)] = policy
    return out
