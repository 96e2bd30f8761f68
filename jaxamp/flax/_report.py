"""Precision report: per module, the dtypes it stores, computes in and returns.

`precision_report(model, *inputs, policy=...)` traces one forward pass abstractly (no FLOPs, no
device memory: `jax.eval_shape`) and records, for every module call:

* ``params``: the dtypes the module's own params are stored in;
* ``compute``: the dtype the module's code computes in (the floating output its own code returns,
  before any policy cast);
* ``inputs``: the dtype of the floating inputs its code receives;
* ``output``: the dtype its caller receives (after the policy's output cast);
* ``policy`` and ``rule``: the effective policy and the rule that set it (with a policy).

Flags:

* ``silent-promotion``: low-precision (float16/bfloat16) inputs computed in float32 because the
  module's params are float32 — Flax's ``dtype=None`` default, where mixed precision silently
  does nothing. A policy fixes it.
* ``wider-than-policy``: the module computes in a wider dtype than its policy's compute dtype
  (e.g. it was built with an explicit ``dtype=jnp.float32``).

Works for linen modules and NNX modules, with or without a policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from jaxamp._policy import Policy, short_dtype_name
from jaxamp.flax import _rules
from jaxamp.flax import linen as jl
from jaxamp.flax import nnx as jn

__all__ = ["ModuleReport", "PrecisionReport", "precision_report"]

_LOW = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    """One module's line of the report (dtype names as strings, e.g. "bfloat16").

    Examples:
      >>> line = jf.precision_report(nn.Dense(2), jnp.ones((1, 3)), policy="bf16-mixed")[""]
      >>> line.module, line.params, line.compute, line.output, line.policy
      ('Dense', ('float32',), 'bfloat16', 'float32', 'p=f32,c=bf16,o=f32')
    """

    path: str
    module: str
    params: tuple[str, ...]
    inputs: str | None
    compute: str | None
    output: str | None
    policy: str | None
    rule: str | None
    flags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Per-module dtypes of a model, in call order.

    Attributes:
      modules: one `ModuleReport` per module path (its first call).
      policy: the global policy's string, or None.

    Examples:
      >>> report = jf.precision_report(nn.Dense(2), jnp.ones((1, 3), jnp.bfloat16))
      >>> report.policy, [m.flags for m in report.modules]
      (None, [('silent-promotion',)])
      >>> sorted(report.to_dict())
      ['modules', 'policy']
    """

    modules: tuple[ModuleReport, ...]
    policy: str | None

    @property
    def traps(self) -> tuple[ModuleReport, ...]:
        """Modules flagged ``silent-promotion``."""
        return tuple(m for m in self.modules if "silent-promotion" in m.flags)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {"policy": self.policy, "modules": [dataclasses.asdict(m) for m in self.modules]}

    def __getitem__(self, path: str) -> ModuleReport:
        for module in self.modules:
            if module.path == path:
                return module
        raise KeyError(f"no module at path {path!r}; paths: {[m.path for m in self.modules]}")

    def __str__(self) -> str:
        header = ("path", "module", "params", "inputs", "compute", "output", "rule", "flags")
        rows = [
            (
                m.path or "<root>",
                m.module,
                ",".join(_short(p) for p in m.params) or "-",
                _short(m.inputs),
                _short(m.compute),
                _short(m.output),
                m.rule or "-",
                ",".join(m.flags) or "",
            )
            for m in self.modules
        ]
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines = [f"precision report (policy: {self.policy or 'none'})"]
        for row in [header, *rows]:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
        if self.traps:
            lines.append(
                f"{len(self.traps)} module(s) silently promote low-precision inputs to float32 "
                "(float32 params, dtype=None): use a jaxamp policy or set dtype=."
            )
        return "\n".join(lines)


def _short(name: str | None) -> str:
    return "-" if name is None else short_dtype_name(name)


def _float_dtype(tree: Any) -> str | None:
    for leaf in jax.tree.leaves(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            return np.dtype(dtype).name
    return None


def _flags(params, inputs, compute, policy: Policy | None) -> tuple[str, ...]:
    flags = []
    if (
        policy is None
        and inputs is not None
        and compute is not None
        and np.dtype(inputs) in _LOW
        and np.dtype(compute).itemsize > np.dtype(inputs).itemsize
        and any(np.dtype(p).itemsize >= 4 for p in params)
    ):
        flags.append("silent-promotion")
    if (
        policy is not None
        and compute is not None
        and np.dtype(compute).itemsize > policy.compute_dtype.itemsize
    ):
        flags.append("wider-than-policy")
    return tuple(flags)


def precision_report(
    model: Any,
    *inputs: Any,
    policy: Any = None,
    rules: _rules.Rules = None,
    variables: Any = None,
    defaults: bool = True,
    float32_softmax: bool = True,
    **kwargs: Any,
) -> PrecisionReport:
    """Traces one forward pass of `model` on `inputs` and reports each module's dtypes.

    Args:
      model: a linen module, or an NNX module (its policy is the one `jf.nnx.apply_policy` gave
        it; `policy` and `rules` are then not accepted).
      *inputs: example inputs (arrays or `jax.ShapeDtypeStruct`s).
      policy: for linen, the global policy to report under (None: the model as written).
      rules, defaults, float32_softmax: linen per-module rules, as `jf.linen.with_policy`.
      variables: linen variables to apply (default: from `model.init`, abstractly).
      **kwargs: keyword arguments for the forward pass (e.g. ``train=False``).

    Returns:
      A `PrecisionReport`; ``print(report)`` shows a table, ``report.traps`` the modules that
      silently promote low-precision inputs to float32.

    Examples:
      >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2)])
      >>> x = jnp.ones((1, 3), jnp.bfloat16)
      >>> [m.path for m in jf.precision_report(model, x).traps]  # float32 params promote
      ['layers_0']
      >>> report = jf.precision_report(model, x, policy="bf16-mixed")
      >>> report["layers_1"].compute, report["layers_2"].compute, report.traps
      ('float32', 'bfloat16', ())
    """
    if isinstance(model, nn.Module):
        return _linen_report(
            model, inputs, kwargs, policy, rules, variables, defaults, float32_softmax
        )
    if isinstance(model, nnx.Module):
        if policy is not None or rules is not None:
            raise ValueError(
                "precision_report: for an NNX model, set the policy with "
                "jf.nnx.apply_policy(model, policy, rules) first; policy= and rules= are for "
                "linen models."
            )
        return _nnx_report(model, inputs, kwargs)
    raise TypeError(
        f"precision_report(model=...) takes a linen or NNX module; got {type(model).__name__}."
    )


def _linen_report(model, inputs, kwargs, policy, rules, variables, defaults, float32_softmax):
    records: dict[str, dict[str, Any]] = {}
    interceptor = None
    if policy is not None:
        interceptor = jl.policy_interceptor(
            policy, rules, defaults=defaults, float32_softmax=float32_softmax
        )
    config = getattr(interceptor, "config", None)

    def outer(next_fun, args, kw, context):
        out = next_fun(*args, **kw)
        record = records.get(_linen_path(context.module))
        if context.method_name == "__call__" and record is not None and "output" not in record:
            record["output"] = _float_dtype(out)
        return out

    def inner(next_fun, args, kw, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kw)
        module = context.module
        path = _linen_path(module)
        first = path not in records
        if first:
            params = module.variables.get("params", {}) if module.scope is not None else {}
            stored = sorted(
                {
                    np.dtype(v.dtype).name
                    for v in params.values()
                    if not isinstance(v, Mapping) and hasattr(v, "dtype")
                }
            )
            effective = jl.current_policy() if config is not None else None
            rule = None
            if config is not None:
                matched = _rules.match(config.user_rules, config.default_rules, module, path)
                rule = _rules.describe_rule(matched, matched in config.default_rules)
            records[path] = {
                "module": type(module).__name__,
                "params": tuple(stored),
                "inputs": _float_dtype((args, kw)),
                "policy": effective,
                "rule": rule,
            }
        out = next_fun(*args, **kw)
        if first:
            records[path]["compute"] = _float_dtype(out)
        return out

    def forward(variables, *inputs):
        with nn.intercept_methods(outer):
            if interceptor is not None:
                with nn.intercept_methods(interceptor), nn.intercept_methods(inner):
                    return model.apply(variables, *inputs, **kwargs)
            with nn.intercept_methods(inner):
                return model.apply(variables, *inputs, **kwargs)

    # The report is about what standard promotion does (strict mode would refuse the trap).
    with jax.numpy_dtype_promotion("standard"):
        if variables is None:
            init = (
                model.init
                if interceptor is None
                else jl.with_policy(
                    model.init, policy, rules, defaults=defaults, float32_softmax=float32_softmax
                )
            )
            variables = jax.eval_shape(lambda *a: init(jax.random.key(0), *a, **kwargs), *inputs)
        jax.eval_shape(forward, variables, *inputs)
    return _build(records, None if config is None else str(config.policy))


def _linen_path(module) -> str:
    try:
        return "/".join(module.path)
    except Exception:
        return ""


def _nnx_report(model, inputs, kwargs):
    graphdef, state = nnx.split(model)
    records: dict[str, dict[str, Any]] = {}
    classes = {}
    for _, module in nnx.iter_modules(model):
        base = getattr(type(module), "__jaxamp_base__", None) or type(module)
        if jn.has_own_call(base) and base not in classes:
            classes[base] = base.__dict__.get("__call__")
    info: dict[int, tuple[str, nnx.Module]] = {}

    def make_spy(original):
        def spy(self, *args, **kw):
            entry = info.get(id(self))
            if entry is None:
                return original(self, *args, **kw)
            path, _ = entry
            first = path not in records or "compute" not in records[path]
            out = original(self, *args, **kw)
            if first:
                policy, rule = jn.module_policy(self)
                stored = records.get(path, {}).get("params", ())
                compute = _float_dtype(out)
                records[path] = {
                    "module": (getattr(type(self), "__jaxamp_base__", None) or type(self)).__name__,
                    "params": stored,
                    "inputs": _float_dtype((args, kw)),
                    "compute": compute,
                    "output": policy.output_dtype.name if policy is not None else compute,
                    "policy": policy,
                    "rule": rule,
                }
            return out

        return spy

    def forward(state, *inputs):
        merged = nnx.merge(graphdef, state)
        for path, module in nnx.iter_modules(merged):
            key = _rules.path_string(path)
            if id(module) in info:
                continue
            info[id(module)] = (key, module)
            stored = sorted({np.dtype(p.get_value().dtype).name for p in jn.own_params(module)})
            records[key] = {"params": tuple(stored)}
        return merged(*inputs, **kwargs)

    originals = {base: base.__call__ for base in classes}
    for base, original in originals.items():
        base.__call__ = make_spy(original)
    try:
        with jax.numpy_dtype_promotion("standard"):
            jax.eval_shape(forward, state, *inputs)
    finally:
        for base, own in classes.items():
            if own is None:
                del base.__call__
            else:
                base.__call__ = own
    records = {k: v for k, v in records.items() if "compute" in v}
    root = records.get("", {}).get("policy")
    return _build(records, None if root is None else str(root))


def _build(records: dict[str, dict[str, Any]], policy: str | None) -> PrecisionReport:
    modules = []
    for path, r in records.items():
        effective = r.get("policy")
        modules.append(
            ModuleReport(
                path=path,
                module=r.get("module", "?"),
                params=tuple(r.get("params", ())),
                inputs=r.get("inputs"),
                compute=r.get("compute"),
                output=r.get("output", r.get("compute")),
                policy=None if effective is None else str(effective),
                rule=r.get("rule"),
                flags=_flags(r.get("params", ()), r.get("inputs"), r.get("compute"), effective),
            )
        )
    return PrecisionReport(tuple(modules), policy)
