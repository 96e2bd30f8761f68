"""Op-level autocast: torch.autocast's per-op dtype rules as a jaxpr transform.

``autocast(fn)`` traces ``fn`` to a jaxpr and evaluates it again, equation by equation, with the
casts torch.autocast would insert: ops on torch's lower-precision list run in the autocast dtype,
ops on its float32 lists run in float32, everything else runs in the dtype of its inputs (with
JAX's standard promotion where a cast changed one input of an op and not another). The result is
an ordinary JAX function: it can be jitted, differentiated, vmapped, and costs nothing at run time
beyond the casts themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core
from jax.extend import linear_util as lu
from jax.extend import source_info_util
from jax.interpreters import ad, batching, mlir

from jaxamp import _oplists

__all__ = [
    "autocast",
    "autocast_trace",
    "autocast_rules",
    "full_precision",
    "DtypeRecord",
    "AUTOCAST_CATEGORIES",
]

# Categories a primitive can be given in ``overrides``: torch's, plus "keep" (no list).
AUTOCAST_CATEGORIES = (*_oplists.CATEGORIES, "keep")
_DEVICES = ("cpu", "cuda")
_FULL_PRECISION_SCOPE = "jaxamp_full_precision"
# Only these are ever cast, as torch casts only float16/bfloat16/float32 (never float64 or fp8).
_CASTABLE = frozenset(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
_F32 = jnp.dtype(jnp.float32)
_FP32_CATEGORIES = frozenset({"fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "banned"})
# torch ops that torch itself decomposes (no kernel of their own): their JAX counterparts are left
# to the primitive rules unless the op is on a list.
_COMPOSITE_IN_TORCH = frozenset({"cross_entropy_loss", "einsum"})
_FIRST_ORDER_WITH_JAXPR = frozenset(
    {"reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add", "sort"}
)
_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
# torch ops that also update buffers (running statistics) that keep their dtype under autocast.
_OPS_WITH_BUFFERS = frozenset({"batch_norm"})

# Warn once per unknown higher-order primitive and process (a warning, not state the math reads).
_warned_primitives: set[str] = set()


class DtypeRecord(NamedTuple):
    """One op of a dtype trace: the op, its input dtypes and its output dtypes (names)."""

    op: str
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]


def _default_device() -> str:
    return "cuda" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"


def _check_device(device: str | None) -> str:
    if device is None:
        return _default_device()
    if device not in _DEVICES:
        raise ValueError(
            f"autocast: `device` must be one of {_DEVICES} (torch device types) or None for "
            f"JAX's default backend, got {device!r}."
        )
    return device


def _check_dtype(dtype: Any, device: str) -> np.dtype:
    if dtype is None:
        return jnp.dtype(_oplists.OP_LISTS[device].default_dtype)
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise TypeError(
            f"autocast: `dtype` must be a dtype (float16 or bfloat16) or None, got {dtype!r}."
        ) from err
    if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), _F32):
        raise ValueError(
            f"autocast: `dtype` must be float16, bfloat16 or float32, got {dt.name}. "
            "torch.autocast supports the same (float32 makes lower-precision ops run in float32)."
        )
    return dt


def _op_category(device: str, torch_op: str, op_overrides: Mapping[str, str]) -> str | None:
    """The category of ``torch_op`` on ``device``, after the caller's torch-op overrides."""
    for name in (torch_op, torch_op.split(".")[0]):
        if name in op_overrides:
            return op_overrides[name]
    return _oplists.OP_LISTS[device].category(torch_op)


@functools.cache
def _primitive_categories(
    device: str, op_overrides: tuple[tuple[str, str], ...] = ()
) -> Mapping[str, str]:
    """Primitive name -> category, derived from the torch op list and the counterpart table."""
    changed = dict(op_overrides)
    votes: dict[str, list[str]] = {}
    for torch_op, prims in _oplists.PRIMITIVE_COUNTERPARTS.items():
        if torch_op in _oplists.DIVERGENCES and torch_op not in changed:
            continue
        cat = _op_category(device, torch_op, changed)
        for prim in prims:
            votes.setdefault(prim, [])
            if cat is not None:
                votes[prim].append(cat)
    out = {}
    for prim, cats in votes.items():
        # Composite torch ops (einsum on cpu) reach the same primitive through listed ones; the
        # listed category wins, the most common one if several.
        out[prim] = max(set(cats), key=cats.count) if cats else "keep"
    return out


def autocast_rules(
    device: str | None = None, overrides: Mapping[Any, str | None] | None = None
) -> dict[str, str]:
    """The category autocast gives each JAX primitive on ``device`` (primitives not named: "keep").

    Args:
      device: torch device type, ``"cpu"`` or ``"cuda"``; default from JAX's backend.
      overrides: primitive (or its name) or torch op name -> category, as accepted by
        :func:`autocast`.

    Returns:
      A new dict from primitive name to one of :data:`AUTOCAST_CATEGORIES`.

    Examples:
      >>> jaxamp.autocast_rules("cuda")["exp"]
      'fp32'
      >>> jaxamp.autocast_rules("cpu", overrides={"dot_general": "fp32"})["dot_general"]
      'fp32'
    """
    device = _check_device(device)
    rules = _Rules.build(device, overrides)
    return dict(rules.primitives)


@functools.cache
def _primitive_names() -> frozenset[str]:
    """Names of JAX's own primitives (the keys `overrides` accepts besides torch op names)."""
    from jax.extend.core import primitives

    return (
        frozenset(v.name for v in vars(primitives).values() if isinstance(v, jex_core.Primitive))
        | frozenset(_primitive_categories("cpu"))
        | frozenset(_primitive_categories("cuda"))
    )


@functools.cache
def _torch_op_names() -> frozenset[str]:
    """torch op names (with and without overload) that `overrides` accepts."""
    names = set(_oplists.FUNCTION_COUNTERPARTS) | set(_oplists.PRIMITIVE_COUNTERPARTS)
    for oplist in _oplists.OP_LISTS.values():
        names.update(oplist.ops)
    return frozenset(names | {n.split(".")[0] for n in names})


def _unknown_key_error(name: str) -> ValueError:
    import difflib

    close = difflib.get_close_matches(
        name, sorted(_primitive_names() | _torch_op_names()), n=1, cutoff=0.6
    )
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return ValueError(
        f"autocast: unknown `overrides` key {name!r}{hint} Keys are JAX primitives or their "
        "names (dot_general, conv_general_dilated, exp, reduce_sum, ...: jaxamp.autocast_rules()"
        " lists those with rules) or torch op names from the op lists (linear, conv2d, "
        "softmax, layer_norm, ...: jaxamp.autocast_op_list(device).ops)."
    )


def _check_overrides(
    overrides: Mapping[Any, str | None] | None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Validated overrides split into (primitive name -> category, torch op -> category)."""
    if overrides is None:
        return {}, {}
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "autocast: `overrides` must be a mapping from primitive (or primitive name, or torch "
            f"op name) to a category, got {type(overrides).__name__}."
        )
    prims, ops = {}, {}
    for key, cat in overrides.items():
        is_prim = isinstance(key, jex_core.Primitive)
        name = key.name if is_prim else key
        if not isinstance(name, str):
            raise TypeError(
                "autocast: `overrides` keys must be primitives, primitive names or torch op "
                f"names, got {key!r}."
            )
        cat = "keep" if cat is None else cat
        if cat not in AUTOCAST_CATEGORIES:
            import difflib

            close = difflib.get_close_matches(str(cat), AUTOCAST_CATEGORIES, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"autocast: `overrides[{name!r}]` must be one of {AUTOCAST_CATEGORIES} or None, "
                f"got {cat!r}{hint}."
            )
        if is_prim or name in _primitive_names():
            prims[name] = cat
        elif name in _torch_op_names():
            ops[name] = cat
        else:
            raise _unknown_key_error(name)
    return prims, ops


@dataclasses.dataclass(frozen=True)
class _Rules:
    """Everything autocast decides by, for one device and one set of overrides.

    ``primitives``: primitive name -> category (torch op lists through the counterpart table,
    then the primitive overrides). ``forced``: primitives the user overrode; their category holds
    wherever they run, inside composite regions too. ``functions``: library function (file,
    first line) -> (torch op, category), the composite regions.
    """

    primitives: Mapping[str, str]
    forced: Mapping[str, str]
    functions: Mapping[tuple[str, int], tuple[str, str]]

    @staticmethod
    def build(device: str, overrides: Mapping[Any, str | None] | None) -> _Rules:
        prims, ops = _check_overrides(overrides)
        op_key = tuple(sorted(ops.items()))
        primitives = {**_primitive_categories(device, op_key), **prims}
        return _Rules(primitives, prims, _function_table(device, op_key))

    def region_category(self, torch_op: str, category: str) -> str:
        """A composite's category: a primitive override of its kernel (linear's dot_general)
        moves the whole composite, as moving the torch op would."""
        kernel = [
            self.forced[p]
            for p in _oplists.PRIMITIVE_COUNTERPARTS.get(torch_op.split(".")[0], ())
            if p in self.forced
        ]
        return kernel[0] if kernel else category


def _resolve(spec: str) -> Any:
    module_name, qualname = spec.split(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@functools.cache
def _function_table(
    device: str, op_overrides: tuple[tuple[str, str], ...] = ()
) -> Mapping[tuple[str, int], tuple[str, str]]:
    """(file, first line) of JAX library functions -> (torch op, category)."""
    changed = dict(op_overrides)
    table = {}
    for torch_op, specs in _oplists.FUNCTION_COUNTERPARTS.items():
        cat = _op_category(device, torch_op, changed)
        if cat is None and torch_op in _COMPOSITE_IN_TORCH:
            continue  # torch decomposes it; the primitive rules already match its pieces
        for spec in specs:
            try:
                fn = inspect.unwrap(_resolve(spec))
                code = fn.__code__
            except (ImportError, AttributeError):
                continue  # an optional library or a renamed function: no region for it
            table[(code.co_filename, code.co_firstlineno)] = (torch_op, cat or "keep")
    return table


@dataclasses.dataclass(frozen=True)
class _Region:
    """A stretch of equations that follows one category: a torch op's composite or a marker."""

    category: str  # a category, or "as_written" for full-precision regions
    key: Any = None
    cast_outputs_like_input: bool = False
    # Only outputs shaped like the input take its dtype (batch_norm's running statistics are
    # buffers that keep their own dtype in torch).
    only_input_shaped: bool = False


_AS_WRITTEN = _Region("as_written", key="full_precision")


def _plain_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as a NumPy dtype, or None for an extended dtype (typed PRNG keys, ...).

    Extended dtypes are not NumPy dtypes (``np.dtype``/``jnp.dtype`` raise on them): every dtype
    helper goes through here, and autocast never casts such values.
    """
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    return jnp.dtype(dtype)


def _dtype_of(x: Any) -> np.dtype | None:
    """The plain dtype of a value or aval; None without one or for extended dtypes."""
    return _plain_dtype(getattr(x, "dtype", None))


def _dtype_name(x: Any) -> str:
    return str(x.dtype)


def _is_castable(x: Any) -> bool:
    return _dtype_of(x) in _CASTABLE


def _cast(x: Any, dtype: np.dtype) -> Any:
    if not _is_castable(x) or _dtype_of(x) == dtype:
        return x
    return lax.convert_element_type(x, dtype)


def _promote(dtypes: Sequence[np.dtype], weak: Sequence[bool]) -> np.dtype:
    """JAX's standard promotion restricted to floats, computed here so strict mode allows it."""
    strong = [d for d, w in zip(dtypes, weak, strict=False) if not w] or list(dtypes)
    if all(d == strong[0] for d in strong):
        return strong[0]
    if any(d == jnp.dtype(jnp.float64) for d in strong):
        return jnp.dtype(jnp.float64)
    # Any mix of float16, bfloat16 and float32 promotes to float32 in JAX (and in torch).
    return _F32


def _aval_dtype(atom: Any) -> np.dtype | None:
    return _dtype_of(getattr(atom, "aval", None))


def _explicit_out_dtype(eqn: Any) -> bool:
    """Whether the user gave this op an explicit output dtype (autocast leaves those alone)."""
    params = eqn.params
    if params.get("out_dtype") is not None:
        return True
    pet = params.get("preferred_element_type")
    if pet is None:
        return False
    in_dtypes = [_aval_dtype(v) for v in eqn.invars]
    in_dtypes = [d for d in in_dtypes if d is not None]
    # JAX fills preferred_element_type with the input dtype by default: only a different one
    # (e.g. bfloat16 inputs accumulated in float32) is the user's request.
    return bool(in_dtypes) and all(_plain_dtype(pet) != d for d in in_dtypes)


class _Interpreter:
    def __init__(self, device: str, dtype: np.dtype, rules: _Rules, record: list | None):
        self.device = device
        self.dtype = dtype
        self.rules = rules.primitives
        self.forced = rules.forced
        self.functions = rules.functions
        self.region_category = rules.region_category
        self.record = record

    # -- regions -----------------------------------------------------------------------------

    def _eqn_region(self, eqn: Any, parent: _Region | None) -> _Region | None:
        if parent is not None and parent.category == "as_written":
            return parent
        if _FULL_PRECISION_SCOPE in str(eqn.source_info.name_stack):
            return _AS_WRITTEN
        if parent is not None:
            return parent
        if not self.functions:
            return None
        tb = eqn.source_info.traceback
        if tb is None:
            return None
        frames = tb.frames
        # Outermost match wins: attention's softmax belongs to attention.
        for i in range(len(frames) - 1, -1, -1):
            fr = frames[i]
            hit = self.functions.get((fr.file_name, fr.function_start_line))
            if hit is not None:
                torch_op, cat = hit
                cat = self.region_category(torch_op, cat)
                call_site = tuple((f.file_name, f.line_num) for f in frames[i + 1 :])
                return _Region(
                    cat,
                    key=(torch_op, call_site),
                    cast_outputs_like_input=cat == "keep",
                    only_input_shaped=torch_op in _OPS_WITH_BUFFERS,
                )
        return None

    def _call_region(self, eqn: Any, jaxpr: Any, parent: _Region | None) -> _Region | None:
        region = self._eqn_region(eqn, parent)
        if region is not None:
            return region
        # A jitted library function (jax.nn.log_softmax) is its own region.
        info = getattr(jaxpr, "debug_info", None)
        src = getattr(info, "func_src_info", None) or ""
        m = re.match(r"(\S+) at (.+):(\d+)$", src)
        if m and self.functions:
            hit = self.functions.get((m.group(2), int(m.group(3))))
            if hit is not None:
                torch_op, cat = hit
                cat = self.region_category(torch_op, cat)
                return _Region(cat, key=(torch_op, id(eqn)), cast_outputs_like_input=cat == "keep")
        return None

    # -- evaluation --------------------------------------------------------------------------

    def eval_closed(self, closed: Any, args: Sequence[Any], region: _Region | None) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, region)

    def eval_jaxpr(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], region: _Region | None
    ) -> list:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=False):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=False):
            env[v] = x

        regions = [self._eqn_region(e, region) for e in jaxpr.eqns]
        # Regions whose torch op returns its input's dtype: cast values that leave the region.
        region_input: dict[int, Any] = {}
        inst = self._instances(regions)
        producer: dict[Any, int] = {}
        leaving = set()
        for j, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if isinstance(v, jex_core.Var) and v in producer and inst[producer[v]] != inst[j]:
                    leaving.add(v)
            for v in eqn.outvars:
                producer[v] = j
        for v in jaxpr.outvars:
            if isinstance(v, jex_core.Var):
                leaving.add(v)

        for j, eqn in enumerate(jaxpr.eqns):
            reg = regions[j]
            vals = [read(v) for v in eqn.invars]
            if reg is not None and reg.cast_outputs_like_input:
                # The op's input is its first array operand from outside (not a constant).
                self._note_region_input(eqn, vals, inst, j, producer, region_input)
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
                outs = self._eval_eqn(eqn, vals, reg)
            in_region_dtype, _, in_region_shape = (
                region_input.get(inst[j], (None, None, None))
                if reg is not None and reg.cast_outputs_like_input
                else (None, None, None)
            )
            for v, x in zip(eqn.outvars, outs, strict=False):
                if (
                    in_region_dtype is not None
                    and v in leaving
                    and _is_castable(x)
                    and not (reg.only_input_shaped and np.shape(x) != in_region_shape)
                ):
                    x = _cast(x, in_region_dtype)
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    @staticmethod
    def _note_region_input(eqn, vals, inst, j, producer, region_input) -> None:
        prev = region_input.get(inst[j])
        if prev is not None and prev[1]:
            return
        for v, x in zip(eqn.invars, vals, strict=False):
            internal = (
                isinstance(v, jex_core.Var) and v in producer and inst[producer[v]] == inst[j]
            )
            if _is_castable(x) and not internal:
                is_array = np.ndim(x) > 0
                if prev is None or is_array:
                    region_input[inst[j]] = (_dtype_of(x), is_array, np.shape(x))
                    return

    @staticmethod
    def _instances(regions: Sequence[_Region | None]) -> list[int]:
        # Contiguous equations with the same region key form one call of the function.
        inst, n, prev = [], 0, object()
        for r in regions:
            key = None if r is None else r.key
            if key is None or key != prev:
                n += 1
            prev = key
            inst.append(n)
        return inst

    def _eval_eqn(self, eqn: Any, vals: list, region: _Region | None) -> list:
        prim = eqn.primitive
        name = prim.name
        handler = _HIGHER_ORDER.get(name)
        if handler is not None:
            outs = handler(self, eqn, vals, region)
            return list(outs)
        if prim is _explicit_cast_p:
            return [self._explicit_cast(vals[0], eqn.params["dtype"], region)]
        if name in _FIRST_ORDER_WITH_JAXPR or name.startswith("scatter"):
            # A combiner jaxpr (scatter-add's add) typed for the traced dtypes: run as written.
            return self._bind(eqn, self._as_written(eqn, vals), dict(eqn.params))
        if next(iter(jex_core.jaxprs_in_params(eqn.params)), None) is not None:
            if name not in _warned_primitives:
                _warned_primitives.add(name)
                warnings.warn(
                    f"jaxamp.autocast: higher-order primitive {name!r} is not supported; it is "
                    "evaluated unchanged, without autocast inside it.",
                    stacklevel=2,
                )
            return self._bind(eqn, self._as_written(eqn, vals), dict(eqn.params))
        if name in self.forced and not (region is not None and region.category == "as_written"):
            category = self.forced[name]  # the user's override holds wherever the op runs
        elif region is not None:
            category = region.category
        else:
            category = self.rules.get(name, "keep")
        if _explicit_out_dtype(eqn):
            category = "as_written"
        params = dict(eqn.params)
        if category == "as_written":
            new_vals = self._as_written(eqn, vals)
        elif category == "lower_precision_fp" or category in _FP32_CATEGORIES:
            target = self.dtype if category == "lower_precision_fp" else _F32
            new_vals = [_cast(x, target) for x in vals]
            if params.get("preferred_element_type") is not None:
                params["preferred_element_type"] = target
        else:  # "keep", "promote"
            new_vals = self._promote_groups(eqn, vals)
            pet = params.get("preferred_element_type")
            if pet is not None:
                fl = [_dtype_of(x) for x in new_vals if _is_castable(x)]
                if fl:
                    params["preferred_element_type"] = fl[0]
        try:
            outs = self._bind(eqn, new_vals, params)
        except (TypeError, ValueError):
            # A primitive whose params pin its dtypes: run it exactly as written.
            outs = self._bind(eqn, self._as_written(eqn, vals), dict(eqn.params))
            new_vals = self._as_written(eqn, vals)
        if self.record is not None:
            self.record.append(
                DtypeRecord(
                    name,
                    tuple(_dtype_name(x) for x in new_vals if hasattr(x, "dtype")),
                    tuple(_dtype_name(x) for x in outs if hasattr(x, "dtype")),
                )
            )
        return outs

    def _explicit_cast(self, x: Any, dtype: np.dtype, region: _Region | None) -> Any:
        """A cast the user wrote that JAX elided as a no-op when ``fn`` was traced."""
        if region is not None and region.category == "lower_precision_fp":
            # Inside a torch kernel that runs in lower precision (flax Dense's promote_dtype of
            # its inputs): the kernel casts its operands anyway; no round trip through float32.
            return x
        out = _cast(x, dtype)
        if self.record is not None and out is not x:
            self.record.append(
                DtypeRecord("convert_element_type", (_dtype_name(x),), (dtype.name,))
            )
        return out

    @staticmethod
    def _bind(eqn: Any, vals: Sequence[Any], params: dict) -> list:
        out = eqn.primitive.bind(*vals, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    @staticmethod
    def _as_written(eqn: Any, vals: Sequence[Any]) -> list:
        out = []
        for v, x in zip(eqn.invars, vals, strict=False):
            d = _aval_dtype(v)
            out.append(_cast(x, d) if d is not None and d in _CASTABLE else x)
        return out

    @staticmethod
    def _promote_groups(eqn: Any, vals: Sequence[Any]) -> list:
        # Inputs that had one dtype as traced must share one again: promote each such group.
        groups: dict[np.dtype, list[int]] = {}
        for i, (v, x) in enumerate(zip(eqn.invars, vals, strict=False)):
            d = _aval_dtype(v)
            if d is not None and d in _CASTABLE and _is_castable(x):
                groups.setdefault(d, []).append(i)
        out = list(vals)
        for idx in groups.values():
            dts = [_dtype_of(vals[i]) for i in idx]
            if all(d == dts[0] for d in dts):
                continue
            # Scalars do not promote arrays: weakly typed values in JAX, 0-dim tensors in torch
            # (and strict promotion turns Python scalars into strong literals).
            has_array = any(np.ndim(vals[i]) > 0 for i in idx)
            weak = [
                bool(getattr(eqn.invars[i].aval, "weak_type", False))
                or (has_array and np.ndim(vals[i]) == 0)
                for i in idx
            ]
            target = _promote(dts, weak)
            for i in idx:
                out[i] = _cast(vals[i], target)
        return out


# -- higher-order primitives -------------------------------------------------------------------


def _orig_dtypes(atoms: Sequence[Any]) -> list[np.dtype | None]:
    return [_aval_dtype(a) for a in atoms]


def _cast_to(vals: Sequence[Any], dtypes: Sequence[np.dtype | None]) -> list:
    return [x if d is None else _cast(x, d) for x, d in zip(vals, dtypes, strict=False)]


def _call(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    sub = interp._call_region(eqn, getattr(closed, "jaxpr", closed), region)
    if isinstance(closed, jex_core.ClosedJaxpr):
        outs = interp.eval_closed(closed, vals, sub)
    else:
        outs = interp.eval_jaxpr(closed, (), vals, sub)
    if sub is not None and sub.cast_outputs_like_input and sub is not region:
        first = next((_dtype_of(x) for x in vals if _is_castable(x)), None)
        if first is not None:
            outs = [_cast(x, first) for x in outs]
    return outs


def _remat(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    p = eqn.params

    def body(*args):
        return interp.eval_jaxpr(p["jaxpr"], (), args, region)

    return jax.checkpoint(body, policy=p["policy"], prevent_cse=p["prevent_cse"])(*vals)


def _scan(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = vals[:nc], vals[nc : nc + ncarry], vals[nc + ncarry :]
    # Carries keep their traced dtypes: a loop's state cannot change type between iterations.
    carry_dtypes = _orig_dtypes(eqn.invars[nc : nc + ncarry])

    def body(carry, x):
        outs = interp.eval_closed(p["jaxpr"], [*consts, *carry, *x], region)
        return _cast_to(outs[:ncarry], carry_dtypes), outs[ncarry:]

    kwargs = {}
    if p.get("_split_transpose"):
        kwargs["_split_transpose"] = True
    carry, ys = lax.scan(
        body,
        _cast_to(init, carry_dtypes),
        xs,
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
        **kwargs,
    )
    return [*carry, *ys]


def _while(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
    carry_dtypes = _orig_dtypes(eqn.invars[cn + bn :])

    def cond(carry):
        return interp.eval_closed(p["cond_jaxpr"], [*cconsts, *carry], region)[0]

    def body(carry):
        return _cast_to(
            interp.eval_closed(p["body_jaxpr"], [*bconsts, *carry], region), carry_dtypes
        )

    return list(lax.while_loop(cond, body, _cast_to(init, carry_dtypes)))


def _cond(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    index, ops = vals[0], vals[1:]
    # Branches must agree on output types: they return the dtypes the traced program had.
    out_dtypes = _orig_dtypes(eqn.outvars)

    def branch(closed):
        return lambda *args: _cast_to(interp.eval_closed(closed, args, region), out_dtypes)

    return list(lax.switch(index, [branch(b) for b in eqn.params["branches"]], *ops))


def _out_dtypes_of(fn: Callable, args: Sequence[Any]) -> list:
    shapes = jax.eval_shape(fn, *args)
    return [_dtype_of(s) for s in shapes]


def _custom_jvp(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    params = dict(eqn.params)
    call = params.pop("call_jaxpr")
    nconsts = params.pop("num_consts")
    jvp_fun = params.pop("jvp_jaxpr_fun")
    debug = call.jaxpr.debug_info

    def primal(*args):
        return interp.eval_closed(call, args, region)

    out_dtypes = _out_dtypes_of(primal, vals)

    def jvp(*xs):
        n = len(xs) // 2
        primals, tangents = xs[nconsts:n], xs[n + nconsts :]
        zeros = [type(t) is SymbolicZero for t in tangents]
        jvp_jaxpr, jvp_consts, out_zeros = jvp_fun.call_wrapped(*zeros)
        nz = [t for t, z in zip(tangents, zeros, strict=False) if not z]
        # The user's rule runs under the same autocast rules as the primal.
        out = interp.eval_jaxpr(jvp_jaxpr, jvp_consts, [*primals, *nz], region)
        out_primals = _cast_to(out[: len(out_zeros)], out_dtypes)
        nz_out = iter(out[len(out_zeros) :])
        out_tangents = []
        for p_out, z in zip(out_primals, out_zeros, strict=False):
            if z:
                aval = jax.typeof(p_out).to_tangent_aval()
                out_tangents.append(SymbolicZero(aval))
            else:
                t = next(nz_out)
                out_tangents.append(_cast(t, _dtype_of(p_out)) if _is_castable(p_out) else t)
        return [*out_primals, *out_tangents]

    params["subfuns"] = (
        lu.wrap_init(primal, debug_info=debug),
        lu.wrap_init(jvp, debug_info=jvp_fun.debug_info),
    )
    return list(eqn.primitive.bind(*vals, **params))


def _custom_vjp(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    _, _, bwd = bind_params.pop("subfuns")
    call = eqn.params["call_jaxpr"]
    nconsts = eqn.params["num_consts"]
    fwd_thunk = eqn.params["fwd_jaxpr_thunk"]
    in_dtypes = [_dtype_of(x) for x in vals]
    orig_out_dtypes = [_dtype_of(a) for a in call.out_avals]

    def primal(*args):
        return interp.eval_closed(call, args, region)

    out_dtypes = _out_dtypes_of(primal, vals)
    n_out = len(out_dtypes)

    def fwd(*args):
        xs, nonzeros = args[::2], args[1::2]
        primals = xs[nconsts:]
        fwd_jaxpr, fwd_consts = fwd_thunk.call_wrapped(*nonzeros[nconsts:])
        outs = interp.eval_jaxpr(fwd_jaxpr, fwd_consts, primals, region)
        res, outs = outs[: len(outs) - n_out], outs[len(outs) - n_out :]
        return [*res, *_cast_to(outs, out_dtypes)]

    def bwd_cast(*args):
        res, cts = args[: len(args) - n_out], args[len(args) - n_out :]
        # The user's bwd sees cotangents in the dtypes it was written for.
        cts = [
            _cast(c, d) if isinstance(c, jax.Array | jax.core.Tracer) else c
            for c, d in zip(cts, orig_out_dtypes, strict=False)
        ]
        cts_in = bwd.call_wrapped(*res, *cts)
        return [
            _cast(c, d) if d is not None and isinstance(c, jax.Array | jax.core.Tracer) else c
            for c, d in zip(cts_in, in_dtypes, strict=False)
        ]

    bind_params["subfuns"] = (
        lu.wrap_init(primal, debug_info=call.jaxpr.debug_info),
        lu.wrap_init(fwd, debug_info=fwd_thunk.debug_info),
        lu.wrap_init(bwd_cast, debug_info=bwd.debug_info),
    )
    return list(eqn.primitive.bind(*vals, **bind_params))


def _shard_map(interp: _Interpreter, eqn: Any, vals: list, region: _Region | None) -> list:
    p = eqn.params

    def body(*args):
        return tuple(interp.eval_jaxpr(p["jaxpr"], (), args, region))

    fn = jax.shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(p.get("newly_manual_axes", frozenset())) or frozenset(),
        check_vma=p["check_vma"],
    )
    return list(fn(*vals))


_HIGHER_ORDER: dict[str, Callable[..., list]] = {
    **{name: _call for name in _CALL_PRIMITIVES},
    "remat2": _remat,
    "checkpoint": _remat,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}


# -- explicit casts ----------------------------------------------------------------------------
#
# JAX elides a cast to the dtype a value already has: in ``fn`` traced at float32,
# ``(x @ w).astype(jnp.float32)`` leaves no trace in the jaxpr. Under autocast that matmul runs in
# bfloat16, and torch's ``.float()`` on it yields float32, so the user's cast matters. While
# autocast traces ``fn``, the user-facing casting functions record such casts as no-op
# ``jaxamp_explicit_cast`` equations (JAX forwards a same-dtype ``convert_element_type`` away, so
# it cannot carry the mark); the interpreter turns them into real casts to their dtype. Elsewhere
# the primitive is the identity (no HLO), so a jaxpr traced here and cached by JAX (an inner
# ``jit``) stays correct outside autocast. Outside autocast's own tracing the patched functions
# behave exactly as JAX's.

_explicit_cast_p = jex_core.Primitive("jaxamp_explicit_cast")
_explicit_cast_p.def_impl(lambda x, *, dtype: x)
_explicit_cast_p.def_abstract_eval(lambda aval, *, dtype: aval)
mlir.register_lowering(_explicit_cast_p, lambda ctx, x, *, dtype: [x])
ad.deflinear2(_explicit_cast_p, lambda ct, x, *, dtype: [ct])
batching.defvectorized(_explicit_cast_p)

_JAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(jnp.__file__))) + os.sep
_cast_marking = threading.local()  # .depth > 0 while this thread traces under autocast
_patch_lock = threading.Lock()
_patch_users = 0
_patch_saved: list[tuple[Any, str, Any]] = []


def _marking() -> bool:
    return getattr(_cast_marking, "depth", 0) > 0


def _user_frame(depth: int) -> bool:
    """Whether the caller ``depth`` frames up is user code (not JAX's own library code)."""
    try:
        filename = sys._getframe(depth + 1).f_code.co_filename
    except ValueError:
        return False
    return not os.path.abspath(filename).startswith(_JAX_DIR)


def _mark_cast(x: Any, out: Any, dtype: Any) -> Any:
    """``out`` with a no-op cast recorded if JAX elided the user's same-dtype cast of ``x``."""
    if not isinstance(x, jax.core.Tracer) or not isinstance(out, jax.core.Tracer):
        return out
    want = _plain_dtype(dtype) if dtype is not None else None
    have = _dtype_of(x)
    if want is None or have != want or want not in _CASTABLE or _dtype_of(out) != want:
        return out
    if getattr(out.aval, "weak_type", False) or getattr(x.aval, "weak_type", False):
        return out  # a weak -> strong cast is never elided: it is in the jaxpr already
    return _explicit_cast_p.bind(out, dtype=want)


def _marking_method(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def astype(self, dtype, *args, **kwargs):
        out = orig(self, dtype, *args, **kwargs)
        return _mark_cast(self, out, dtype) if _marking() and _user_frame(1) else out

    return astype


def _marking_function(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def cast(x, *args, **kwargs):
        out = orig(x, *args, **kwargs)
        if not (_marking() and _user_frame(1)):
            return out
        dtype = kwargs.get("dtype", args[0] if args else None)
        return _mark_cast(x, out, dtype)

    return cast


def _marking_convert(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def convert_element_type(operand, new_dtype):
        out = orig(operand, new_dtype)
        return _mark_cast(operand, out, new_dtype) if _marking() and _user_frame(1) else out

    return convert_element_type


def _patch_targets() -> list[tuple[Any, str, Callable]]:
    return [
        (jax.core.Tracer, "astype", _marking_method),
        (jnp, "astype", _marking_function),
        (jnp, "asarray", _marking_function),
        (jnp, "array", _marking_function),
        (lax, "convert_element_type", _marking_convert),
    ]


class _marking_explicit_casts:
    """Context: this thread's user-written same-dtype casts show in the jaxprs it traces."""

    def __enter__(self) -> None:
        global _patch_users
        with _patch_lock:
            if _patch_users == 0:
                for owner, name, wrap in _patch_targets():
                    orig = getattr(owner, name)
                    _patch_saved.append((owner, name, orig))
                    setattr(owner, name, wrap(orig))
            _patch_users += 1
        _cast_marking.depth = getattr(_cast_marking, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        global _patch_users
        _cast_marking.depth -= 1
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                while _patch_saved:
                    owner, name, orig = _patch_saved.pop()
                    setattr(owner, name, orig)


# -- public API --------------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.core.Tracer)


def _trace_and_eval(fn: Callable, args: tuple, kwargs: dict, interp: _Interpreter) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

    # Python scalars, strings and flags stay static, as they would be for a Python call.
    def flat_fn(*dyn):
        full = list(leaves)
        for i, x in zip(dynamic, dyn, strict=False):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    dyn_vals = [leaves[i] for i in dynamic]
    with _marking_explicit_casts():
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
    outs = interp.eval_closed(closed, dyn_vals, None)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


def autocast(
    fn: Callable,
    *,
    dtype: Any = None,
    device: str | None = None,
    overrides: Mapping[Any, str | None] | None = None,
) -> Callable:
    """Runs ``fn`` with torch.autocast's per-op precision rules for a torch device type.

    Ops on torch's lower-precision list for ``device`` (``dot_general``, ``conv_general_dilated``)
    run in ``dtype``; ops on its float32 lists (on ``"cuda"``: ``exp``, ``log``, ``pow``,
    ``rsqrt``, sums, products, cumulative sums, layer norm, losses, ...) run in float32; the rest
    keep their input dtype, with JAX's standard promotion where inputs now differ. Only float16,
    bfloat16 and float32 values are cast. The rules reach inside ``jit``, ``scan``, ``while``,
    ``cond``, ``checkpoint``, ``custom_jvp``/``custom_vjp`` (whose derivative rules still apply,
    under the same casts) and ``shard_map``.

    Decisions where JAX and torch differ:

    * ``dot_general``/``conv_general_dilated`` with a ``preferred_element_type`` other than their
      input dtype (e.g. bfloat16 inputs accumulated in float32) are explicit and left alone. JAX
      records the input dtype there by default, so a float32 matmul is autocast.
    * Loop carries and ``cond`` outputs keep their traced dtypes (a loop state cannot change type).
    * A cast the user wrote (``x.astype(f32)``, ``jnp.astype``/``asarray``/``array`` with a dtype,
      ``lax.convert_element_type``) is honoured even where ``x`` was already that dtype when
      traced (JAX elides such casts; autocast records them while tracing ``fn``), as torch's
      ``.float()`` is. Not seen: casts made inside JAX's own library code or through
      ``jnp.float32(x)``, and those in an inner ``jit``/``scan`` body whose trace JAX had cached
      from a call outside autocast. Inside a lower-precision kernel region (flax ``Dense``) they
      are absorbed by the kernel's cast. ``batch_norm``'s running statistics keep their dtype.
    * Inner ``jit`` calls are inlined into the caller (XLA inlines them anyway); their explicit
      ``in_shardings``/``out_shardings`` are not re-applied.
    * Composites that torch runs as one kernel (flax's LayerNorm, optax's l2/cross-entropy losses,
      ``jnp.mean``, ...) follow that kernel's category; see ``jaxamp._oplists``.
    * Autocast applies to every op in ``fn``'s jaxpr. Put it on the forward pass or loss and
      differentiate outside (as with torch): the backward pass then mirrors the forward's dtypes.

    Args:
      fn: the function to transform. Array arguments (any pytree of them) are traced; Python
        scalars, strings and other leaves are passed through as static values.
      dtype: the lower-precision dtype, float16 or bfloat16 (float32 allowed); default torch's
        default for ``device`` (cpu: bfloat16, cuda: float16).
      device: torch device type whose lists to use, ``"cpu"`` or ``"cuda"``; default ``"cuda"`` on
        a GPU backend, else ``"cpu"``.
      overrides: move ops between lists for this call: key -> one of
        :data:`AUTOCAST_CATEGORIES` (``None`` means ``"keep"``). A key is either a JAX
        primitive (or its name, e.g. ``"dot_general"``), whose category then holds wherever it
        runs, inside library composites too (a flax ``Dense`` is a ``linear`` whose kernel is
        ``dot_general``, so overriding ``dot_general`` moves the whole layer); or a torch op
        name from the op lists (e.g. ``"linear"``, ``"softmax"``), which moves that op as if
        torch's list said so (``"linear"`` moves flax ``Dense`` but not a bare ``a @ b``, which
        is torch's ``matmul``). Unknown keys raise ``ValueError`` with the closest valid name.

    Returns:
      A function with ``fn``'s signature. Output dtypes are what the ops produce under autocast
      (e.g. a linear model returns ``dtype``), as under torch.autocast.

    Examples:
      >>> loss = jaxamp.autocast(loss_fn, device="cuda", dtype=jnp.bfloat16)
      >>> grads = jax.grad(loss)(params, batch)  # float32 params get float32 grads
    """
    if not callable(fn):
        raise TypeError(f"autocast: `fn` must be callable, got {type(fn).__name__}.")
    device = _check_device(device)
    dt = _check_dtype(dtype, device)
    rules = _Rules.build(device, overrides)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return _trace_and_eval(fn, args, kwargs, _Interpreter(device, dt, rules, None))

    return wrapped


def autocast_trace(
    fn: Callable,
    *args: Any,
    dtype: Any = None,
    device: str | None = None,
    overrides: Mapping[Any, str | None] | None = None,
    **kwargs: Any,
) -> list[DtypeRecord]:
    """The dtypes each op of ``fn(*args, **kwargs)`` runs in under :func:`autocast`.

    Nothing is computed: the function is evaluated abstractly. The torch counterpart, recording
    the same table under torch.autocast, is ``parity.dtype_trace.torch_dtype_trace``.

    Args:
      fn: the function.
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      dtype: as for :func:`autocast`.
      device: as for :func:`autocast`.
      overrides: as for :func:`autocast`.
      **kwargs: its keyword arguments.

    Returns:
      A list of :class:`DtypeRecord` ``(op, in_dtypes, out_dtypes)``, one per primitive in
      program order (higher-order primitives are entered, not listed).

    Examples:
      >>> jaxamp.autocast_trace(lambda x: jnp.exp(x @ x), jnp.ones((2, 2)), device="cuda")
      [DtypeRecord(op='dot_general', in_dtypes=('float16', 'float16'), out_dtypes=('float16',)),
       DtypeRecord(op='exp', in_dtypes=('float32',), out_dtypes=('float32',))]

    The casts autocast inserts are not listed; they show in ``in_dtypes``.
    """
    device = _check_device(device)
    dt = _check_dtype(dtype, device)
    rules = _Rules.build(device, overrides)
    record: list[DtypeRecord] = []
    interp = _Interpreter(device, dt, rules, record)

    def run(*a):
        return _trace_and_eval(fn, a, kwargs, interp)

    jax.eval_shape(run, *args)
    return record


def full_precision(fn: Callable) -> Callable:
    """Runs ``fn`` in float32 with autocast disabled, like ``torch.autocast(enabled=False)``.

    Floating float16/bfloat16 array arguments are cast to float32 and, inside :func:`autocast`,
    every op of ``fn`` runs as written (in the dtypes it was traced with). Outside autocast it is
    ``fn`` with its low-precision inputs upcast.

    Args:
      fn: the function to run in full precision.

    Returns:
      A function with ``fn``'s signature.

    Examples:
      >>> stable_loss = jaxamp.full_precision(lambda logits, y: cross_entropy(logits, y))
      >>> loss = jaxamp.autocast(lambda p, x, y: stable_loss(model(p, x), y))(params, x, y)
    """
    if not callable(fn):
        raise TypeError(f"full_precision: `fn` must be callable, got {type(fn).__name__}.")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(_FULL_PRECISION_SCOPE):
            args, kwargs = jax.tree_util.tree_map(
                lambda x: _cast(x, _F32) if _is_array(x) else x, (args, kwargs)
            )
            return fn(*args, **kwargs)

    return wrapped
