"""Per-module policy rules shared by the linen and NNX integrations.

A *rule* maps a matcher to a policy value:

* matchers: a module class (matches instances of it and of its subclasses), a path glob (a
  `str`, matched with `fnmatch` against the "/"-joined module path, e.g. ``"Encoder_0/*"`` in
  linen, ``"blocks/0/attn"`` in NNX; the root's path is ``""``), a compiled regex
  (`re.Pattern`, matched with `search` against the same path), or a predicate
  ``(module, path) -> bool``.
* values: a `Policy` (or anything `jaxamp.get_policy` accepts), used as is, output dtype
  included; or an `override(...)`, which changes some dtypes of the inherited policy.

Precedence, for one module:

1. instance rules (globs, regexes, predicates) that match it: the *last* one given wins;
2. class rules that match it: the most derived class wins (the last one given for ties);
3. the default rules (normalisation layers compute in float32), unless ``defaults=False``;
4. no rule: the module inherits its caller's (parent's) param and compute dtypes and returns
   its output in the caller's compute dtype. The root module uses the global policy.

A module's output is cast to its caller's compute dtype unless its rule is a full `Policy`
(then the policy's output dtype) or an `override` with ``output=``. The root's output is cast
to the global policy's output dtype.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jmp
import numpy as np

from jaxamp._policy import Policy, get_policy, parse_dtype, short_dtype_name

__all__ = ["override", "PolicyOverride", "Rules", "float32_compute", "resolve", "normalize_rules"]


def _dtype(value: Any, name: str) -> np.dtype | None:
    if value is None:
        return None
    return parse_dtype(value, where=f"override({name}={value!r})")


@dataclasses.dataclass(frozen=True)
class PolicyOverride:
    """A partial policy: the dtypes given replace the inherited ones; None keeps them.

    Built with `override`. ``output=None`` means "the caller's compute dtype", so a float32
    LayerNorm inside a bfloat16 block hands bfloat16 activations back to the block.

    Examples:
      >>> rule = jf.override(compute="f32")
      >>> rule
      PolicyOverride(param=None, compute=dtype('float32'), output=None)
      >>> str(rule.apply(jaxamp.get_policy("bf16-mixed"), jnp.bfloat16))
      'p=f32,c=f32,o=bf16'
    """

    param: np.dtype | None = None
    compute: np.dtype | None = None
    output: np.dtype | None = None

    def apply(self, inherited: Policy, caller_compute: Any) -> Policy:
        """The effective policy given the inherited policy and the caller's compute dtype."""
        return Policy(
            param_dtype=self.param if self.param is not None else inherited.param_dtype,
            compute_dtype=self.compute if self.compute is not None else inherited.compute_dtype,
            output_dtype=self.output if self.output is not None else caller_compute,
            reduce_dtype=inherited.reduce_dtype,
        )

    def __str__(self) -> str:
        parts = [
            f"{k}={short_dtype_name(getattr(self, v))}"
            for k, v in (("p", "param"), ("c", "compute"), ("o", "output"))
            if getattr(self, v) is not None
        ]
        return "override(" + ",".join(parts) + ")"


def override(param: Any = None, compute: Any = None, output: Any = None) -> PolicyOverride:
    """A rule value that changes some dtypes of the policy a module would inherit.

    Args:
      param: dtype params are created and stored in (None: inherited).
      compute: dtype the module computes in: its inputs and params are cast to it (None:
        inherited).
      output: dtype of the module's outputs (None: the caller's compute dtype).

    Returns:
      A `PolicyOverride`, to use as a value in `rules`.

    Raises:
      ValueError, TypeError: a dtype is not float16, bfloat16, float32 or float64.

    Examples:
      >>> rules = {nn.Dense: jf.override(compute="float32")}  # every Dense in float32
      >>> rules = {"head/*": jf.override(compute="f32", output="f32")}
      >>> str(jf.override(compute="full", output="bf16"))  # get_policy's dtype names
      'override(c=f32,o=bf16)'
      >>> jf.float32_compute  # the default rule of normalisation layers
      PolicyOverride(param=None, compute=dtype('float32'), output=None)
    """
    return PolicyOverride(
        _dtype(param, "param"), _dtype(compute, "compute"), _dtype(output, "output")
    )


#: The default rule value for normalisation layers: compute in float32, keep the param dtype,
#: hand the caller's compute dtype back (torch on CUDA runs norms in float32).
float32_compute = PolicyOverride(compute=np.dtype(np.float32))

RuleValue = Any  # Policy | str | jmp.Policy | PolicyOverride
Rules = Mapping[Any, RuleValue] | Iterable[tuple[Any, RuleValue]] | None

_INSTANCE, _CLASS = "instance", "class"


@dataclasses.dataclass(frozen=True)
class _Rule:
    kind: str  # "class", "glob", "regex", "predicate"
    key: Any
    value: Policy | PolicyOverride
    order: int

    def describe(self) -> str:
        if self.kind == "class":
            return f"class {self.key.__module__}.{self.key.__qualname__}"
        if self.kind == "glob":
            return f"glob {self.key!r}"
        if self.kind == "regex":
            return f"regex {self.key.pattern!r}"
        return f"predicate {getattr(self.key, '__name__', repr(self.key))}"


def _value(key: Any, value: Any) -> Policy | PolicyOverride:
    if isinstance(value, PolicyOverride):
        return value
    if isinstance(value, (str, jmp.Policy)):
        return get_policy(value)
    raise TypeError(
        f"rules[{key!r}] must be a policy (a jaxamp.Policy, a jmp.Policy or a policy string "
        f"such as 'bf16-mixed' or 'p=f32,c=f32,o=bf16') or jaxamp.flax.override(...); got "
        f"{type(value).__name__} {value!r}."
    )


def normalize_rules(rules: Rules, *, first_order: int = 0) -> tuple[_Rule, ...]:
    """Validates user rules and returns them in a canonical form (order kept)."""
    if rules is None:
        return ()
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                "rules must be a mapping {matcher: policy} or a sequence of (matcher, policy) "
                f"pairs; item {i} is {item!r}."
            )
        key, value = item
        if isinstance(key, type):
            kind = "class"
        elif isinstance(key, str):
            kind = "glob"
        elif isinstance(key, re.Pattern):
            kind = "regex"
        elif callable(key):
            kind = "predicate"
        else:
            raise TypeError(
                "rules keys must be a module class, a path glob (str), a compiled regex "
                f"(re.compile(...)) or a predicate (module, path) -> bool; got "
                f"{type(key).__name__} {key!r}."
            )
        out.append(_Rule(kind, key, _value(key, value), first_order + i))
    return tuple(out)


def _instance_match(rule: _Rule, module: Any, path: str) -> bool:
    if rule.kind == "glob":
        return fnmatch.fnmatchcase(path, rule.key)
    if rule.kind == "regex":
        return rule.key.search(path) is not None
    return bool(rule.key(module, path))


def rule_matches(rule: _Rule, module: Any, path: str, cls: type | None = None) -> bool:
    """Whether `rule` matches `module` at `path`, whatever its precedence."""
    if rule.kind == "class":
        return issubclass(type(module) if cls is None else cls, rule.key)
    return _instance_match(rule, module, path)


class UnmatchedRuleWarning(UserWarning):
    """A per-module rule matched no module of the model (likely a misspelled path or class).

    Examples:
      >>> import warnings
      >>> init = jf.linen.with_policy(nn.Dense(2).init, "bf16-mixed", {"Dense_9": "fp32"})
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = init(jax.random.key(0), jnp.ones((1, 3)))
      >>> caught[0].category.__name__, "matched no module" in str(caught[0].message)
      ('UnmatchedRuleWarning', True)
    """


def warn_unmatched(
    user_rules: tuple[_Rule, ...], matched: set[int], paths: Iterable[str], classes: Iterable[type]
) -> None:
    """Warns once per user rule whose ``order`` is not in `matched`, naming the closest path."""
    paths = sorted(set(paths))
    class_names = sorted({c.__name__ for c in classes})
    for rule in user_rules:
        if rule.order in matched:
            continue
        if rule.kind == "class":
            close = difflib.get_close_matches(rule.key.__name__, class_names, n=1, cutoff=0.6)
            hint = f" Did you mean class {close[0]}?" if close else ""
            seen = f"classes seen: {', '.join(class_names)}"
        elif rule.kind == "glob" or rule.kind == "regex":
            text = rule.key if rule.kind == "glob" else rule.key.pattern
            close = difflib.get_close_matches(text, [p for p in paths if p], n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            seen = f"module paths: {', '.join(repr(p) for p in paths[:12])}"
            seen += ", ..." if len(paths) > 12 else ""
        else:
            hint, seen = "", f"{len(paths)} modules"
        warnings.warn(
            f"rules[{rule.key!r}] matched no module, so it has no effect.{hint} ({seen})",
            UnmatchedRuleWarning,
            stacklevel=3,
        )


def _best_class_rule(rules: Iterable[_Rule], cls: type) -> _Rule | None:
    mro = cls.__mro__
    best, best_rank = None, None
    for rule in rules:
        if rule.kind != "class" or not issubclass(cls, rule.key):
            continue
        rank = (-mro.index(rule.key) if rule.key in mro else -len(mro), rule.order)
        if best_rank is None or rank >= best_rank:
            best, best_rank = rule, rank
    return best


def match(
    user_rules: tuple[_Rule, ...],
    default_rules: tuple[_Rule, ...],
    module: Any,
    path: str,
    cls: type | None = None,
) -> _Rule | None:
    """The rule that applies to `module` at `path`, by the documented precedence, or None.

    `cls` is the class that class rules match against (default: ``type(module)``).
    """
    cls = type(module) if cls is None else cls
    instance = [r for r in user_rules if r.kind != "class" and _instance_match(r, module, path)]
    if instance:
        return instance[-1]
    found = _best_class_rule(user_rules, cls)
    if found is not None:
        return found
    return _best_class_rule(default_rules, cls)


def resolve(rule: _Rule | None, inherited: Policy, caller_compute: Any, *, is_root: bool) -> Policy:
    """The effective policy of a module given its rule and what it inherits.

    Args:
      rule: the matching rule or None.
      inherited: the caller's effective policy (the global policy for the root).
      caller_compute: the caller's compute dtype (for the root: the global output dtype).
      is_root: whether the module is the outermost one.
    """
    if rule is None:
        output = inherited.output_dtype if is_root else caller_compute
        return dataclasses.replace(inherited, output_dtype=output)
    if isinstance(rule.value, PolicyOverride):
        return rule.value.apply(inherited, caller_compute)
    return rule.value


def path_string(parts: Iterable[Any]) -> str:
    """'/'-joined path of a module (the root's is '')."""
    return "/".join(str(p) for p in parts)


def check_policy(policy: Any, name: str = "policy") -> Policy:
    """`get_policy` with the parameter name in the error."""
    if policy is None:
        raise TypeError(
            f"{name} must be a policy (e.g. 'bf16-mixed', 'fp16-mixed', 'fp32', "
            "'p=f32,c=bf16,o=f32' or a jaxamp.Policy); got None."
        )
    return get_policy(policy)


def root_rule_policy(rule: _Rule | None, global_policy: Policy) -> Policy:
    """Effective policy of the root module."""
    return resolve(rule, global_policy, global_policy.output_dtype, is_root=True)


def describe_rule(rule: _Rule | None, is_default: bool) -> str:
    if rule is None:
        return "inherited"
    prefix = "default " if is_default else ""
    return f"{prefix}{rule.describe()} -> {rule.value}"


Predicate = Callable[[Any, str], bool]
