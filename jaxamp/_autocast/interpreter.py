"""The interpreter: evaluates a jaxpr again, equation by equation, with autocast's casts.

Extension point (for `jaxamp.fp8` and other op replacements): ``Interpreter(..., hooks=...)``
takes ``{primitive name: hook}``. For every first-order equation of that primitive, after
autocast has chosen its category and cast its operands, the hook receives an `OpCall` and
returns the equation's outputs (a list) to replace the primitive, or ``None`` to let autocast
bind it as usual. Hooks see the operands autocast would use (``call.args``) and the ones the
equation received (``call.original_args``), the category, the torch op whose composite the
equation belongs to (``"linear"`` inside a flax ``Dense``) and the name stack, so a filter can
pick modules by name.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.extend import source_info_util

from jaxamp._autocast.dtypes import (
    CASTABLE,
    F32,
    aval_dtype,
    cast,
    dtype_of,
    is_castable,
    plain_dtype,
    promote,
    value_dtype_name,
)
from jaxamp._autocast.explicit_casts import explicit_cast_p
from jaxamp._autocast.higher_order import HIGHER_ORDER
from jaxamp._autocast.rules import (
    AS_WRITTEN,
    FP32_CATEGORIES,
    FULL_PRECISION_SCOPE,
    OPS_WITH_BUFFERS,
    Region,
    Rules,
)

__all__ = ["DtypeRecord", "Hook", "Interpreter", "OpCall"]

_FIRST_ORDER_WITH_JAXPR = frozenset(
    {"reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add", "sort"}
)
# Warn once per unknown higher-order primitive and process (a warning, not state the math reads).
_warned_primitives: set[str] = set()


class DtypeRecord(NamedTuple):
    """One op of a dtype trace: the op, its input dtypes and its output dtypes (names).

    Examples:
      >>> record = jaxamp.autocast_trace(lambda x: x @ x, jnp.ones((2, 2)), device="cpu")[0]
      >>> record.op, record.in_dtypes, record.out_dtypes
      ('dot_general', ('bfloat16', 'bfloat16'), ('bfloat16',))
    """

    op: str
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One equation as a hook sees it (see the module docstring).

    Attributes:
      primitive: the JAX primitive (e.g. ``lax.dot_general_p``).
      args: operands after autocast's casts for ``category``.
      params: the primitive's params (``preferred_element_type`` already adjusted).
      original_args: operands as the equation received them.
      category: the category autocast chose (one of ``AUTOCAST_CATEGORIES`` or "as_written").
      dtype: autocast's lower-precision dtype.
      device: the torch device type whose lists are used.
      torch_op: the torch op whose library composite the equation is in, or None.
      name_stack: the equation's JAX name stack (module names under Flax), as a string.
    """

    primitive: Any
    args: tuple
    params: Mapping[str, Any]
    original_args: tuple
    category: str
    dtype: np.dtype
    device: str
    torch_op: str | None
    name_stack: str

    def bind(self, *args: Any, **params: Any) -> list:
        """Binds the primitive (default: autocast's own operands and params); returns a list."""
        out = self.primitive.bind(*(args or self.args), **{**self.params, **params})
        return list(out) if self.primitive.multiple_results else [out]


Hook = Callable[[OpCall], "list | None"]


def _explicit_out_dtype(eqn: Any) -> bool:
    """Whether the user gave this op an explicit output dtype (autocast leaves those alone)."""
    params = eqn.params
    if params.get("out_dtype") is not None:
        return True
    pet = params.get("preferred_element_type")
    if pet is None:
        return False
    in_dtypes = [aval_dtype(v) for v in eqn.invars]
    in_dtypes = [d for d in in_dtypes if d is not None]
    # JAX fills preferred_element_type with the input dtype by default: only a different one
    # (e.g. bfloat16 inputs accumulated in float32) is the user's request.
    return bool(in_dtypes) and all(plain_dtype(pet) != d for d in in_dtypes)


def _casts_back(eqn: Any, traced: np.dtype | None, actual: np.dtype | None) -> bool:
    """Whether `eqn` is a library composite casting its result back to the input dtype it was
    traced with (``jnp.mean`` of float16: float32 sum, then float16), where the input autocast
    gives the composite is wider than that (float32)."""
    if traced is None or actual is None or eqn.primitive is not lax.convert_element_type_p:
        return False
    new = plain_dtype(eqn.params["new_dtype"])
    return new == traced and {traced, actual} <= CASTABLE and traced.itemsize < actual.itemsize


class Interpreter:
    """Evaluates jaxprs under one autocast call's rules.

    Args:
      device: torch device type whose lists are used.
      dtype: the lower-precision dtype.
      rules: the call's `Rules`.
      record: a list to append one `DtypeRecord` per evaluated equation to, or None.
      hooks: primitive name -> `Hook` (see the module docstring).
    """

    def __init__(
        self,
        device: str,
        dtype: np.dtype,
        rules: Rules,
        record: list | None,
        hooks: Mapping[str, Hook] | None = None,
    ):
        self.hooks = dict(hooks or {})
        self.device = device
        self.dtype = dtype
        self.rules = rules.primitives
        self.forced = rules.forced
        self.functions = rules.functions
        self.region_category = rules.region_category
        self.record = record

    # -- regions -----------------------------------------------------------------------------

    def _eqn_region(self, eqn: Any, parent: Region | None) -> Region | None:
        if parent is not None and parent.category == "as_written":
            return parent
        if FULL_PRECISION_SCOPE in str(eqn.source_info.name_stack):
            return AS_WRITTEN
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
                return Region(
                    cat,
                    key=(torch_op, call_site),
                    cast_outputs_like_input=cat == "keep",
                    torch_op=torch_op,
                    only_input_shaped=torch_op in OPS_WITH_BUFFERS,
                )
        return None

    def _call_region(self, eqn: Any, jaxpr: Any, parent: Region | None) -> Region | None:
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
                return Region(
                    cat,
                    key=(torch_op, id(eqn)),
                    cast_outputs_like_input=cat == "keep",
                    torch_op=torch_op,
                )
        return None

    # -- evaluation --------------------------------------------------------------------------

    def eval_closed(self, closed: Any, args: Sequence[Any], region: Region | None) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, region)

    def eval_jaxpr(
        self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], region: Region | None
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
            in_region_dtype, _, in_region_shape, traced_in_dtype = (
                region_input.get(inst[j], (None, None, None, None))
                if reg is not None and reg.cast_outputs_like_input
                else (None, None, None, None)
            )
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
                if _casts_back(eqn, traced_in_dtype, in_region_dtype):
                    outs = [self._region_cast_back(vals[0], in_region_dtype)]
                else:
                    outs = self._eval_eqn(eqn, vals, reg)
            for v, x in zip(eqn.outvars, outs, strict=False):
                if (
                    in_region_dtype is not None
                    and v in leaving
                    and is_castable(x)
                    and not (reg.only_input_shaped and np.shape(x) != in_region_shape)
                ):
                    x = cast(x, in_region_dtype)
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _region_cast_back(self, x: Any, dtype: np.dtype) -> Any:
        """A composite's cast back to the dtype it was traced with, now that its input is wider:
        the composite returns its input's dtype (as the torch op does), with no round trip
        through the narrower one (``jnp.mean`` of float32 values stays float32 throughout)."""
        out = cast(x, dtype)
        if self.record is not None:
            self.record.append(
                DtypeRecord(
                    "convert_element_type", (value_dtype_name(x),), (value_dtype_name(out),)
                )
            )
        return out

    @staticmethod
    def _note_region_input(eqn, vals, inst, j, producer, region_input) -> None:
        prev = region_input.get(inst[j])
        if prev is not None and prev[1]:
            return
        for v, x in zip(eqn.invars, vals, strict=False):
            internal = (
                isinstance(v, jex_core.Var) and v in producer and inst[producer[v]] == inst[j]
            )
            if is_castable(x) and not internal:
                is_array = np.ndim(x) > 0
                if prev is None or is_array:
                    region_input[inst[j]] = (dtype_of(x), is_array, np.shape(x), aval_dtype(v))
                    return

    @staticmethod
    def _instances(regions: Sequence[Region | None]) -> list[int]:
        # Contiguous equations with the same region key form one call of the function.
        inst, n, prev = [], 0, object()
        for r in regions:
            key = None if r is None else r.key
            if key is None or key != prev:
                n += 1
            prev = key
            inst.append(n)
        return inst

    def _eval_eqn(self, eqn: Any, vals: list, region: Region | None) -> list:
        prim = eqn.primitive
        name = prim.name
        handler = HIGHER_ORDER.get(name)
        if handler is not None:
            outs = handler(self, eqn, vals, region)
            return list(outs)
        if prim is explicit_cast_p:
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
        elif category == "lower_precision_fp" or category in FP32_CATEGORIES:
            target = self.dtype if category == "lower_precision_fp" else F32
            new_vals = [cast(x, target) for x in vals]
            if params.get("preferred_element_type") is not None:
                params["preferred_element_type"] = target
            if (
                target == F32
                and region is not None
                and prim is lax.convert_element_type_p
                and plain_dtype(params["new_dtype"]) in CASTABLE
            ):
                # Inside a float32 composite (a loss's logsumexp traced in float16), the
                # library's casts back to the traced dtype stay float32, as torch's op does.
                params["new_dtype"] = F32
        else:  # "keep", "promote"
            new_vals = self._promote_groups(eqn, vals)
            pet = params.get("preferred_element_type")
            if pet is not None:
                fl = [dtype_of(x) for x in new_vals if is_castable(x)]
                if fl:
                    params["preferred_element_type"] = fl[0]
        hook = self.hooks.get(name)
        outs = None
        if hook is not None and category != "as_written":
            call = OpCall(
                primitive=prim,
                args=tuple(new_vals),
                params=params,
                original_args=tuple(vals),
                category=category,
                dtype=self.dtype,
                device=self.device,
                torch_op=None if region is None else region.torch_op,
                name_stack=str(eqn.source_info.name_stack),
            )
            outs = hook(call)
        if outs is not None:
            outs = list(outs)
        else:
            outs, new_vals = self._try_bind(eqn, vals, new_vals, params)
        if self.record is not None:
            self.record.append(
                DtypeRecord(
                    name,
                    tuple(value_dtype_name(x) for x in new_vals if hasattr(x, "dtype")),
                    tuple(value_dtype_name(x) for x in outs if hasattr(x, "dtype")),
                )
            )
        return outs

    def _try_bind(self, eqn: Any, vals: list, new_vals: list, params: dict) -> tuple[list, list]:
        """Binds with autocast's operands; returns the outputs and the operands used."""
        try:
            outs = self._bind(eqn, new_vals, params)
        except (TypeError, ValueError):
            # A primitive whose params pin its dtypes: run it exactly as written.
            outs = self._bind(eqn, self._as_written(eqn, vals), dict(eqn.params))
            new_vals = self._as_written(eqn, vals)
        return outs, new_vals

    def _explicit_cast(self, x: Any, dtype: np.dtype, region: Region | None) -> Any:
        """A cast the user wrote that JAX elided as a no-op when ``fn`` was traced."""
        if region is not None and region.category == "lower_precision_fp":
            # Inside a torch kernel that runs in lower precision (flax Dense's promote_dtype of
            # its inputs): the kernel casts its operands anyway; no round trip through float32.
            return x
        out = cast(x, dtype)
        if self.record is not None and out is not x:
            self.record.append(
                DtypeRecord("convert_element_type", (value_dtype_name(x),), (dtype.name,))
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
            d = aval_dtype(v)
            out.append(cast(x, d) if d is not None and d in CASTABLE else x)
        return out

    @staticmethod
    def _promote_groups(eqn: Any, vals: Sequence[Any]) -> list:
        # Inputs that had one dtype as traced must share one again: promote each such group.
        groups: dict[np.dtype, list[int]] = {}
        for i, (v, x) in enumerate(zip(eqn.invars, vals, strict=False)):
            d = aval_dtype(v)
            if d is not None and d in CASTABLE and is_castable(x):
                groups.setdefault(d, []).append(i)
        out = list(vals)
        for idx in groups.values():
            dts = [dtype_of(vals[i]) for i in idx]
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
            target = promote(dts, weak)
            for i in idx:
                out[i] = cast(vals[i], target)
        return out
