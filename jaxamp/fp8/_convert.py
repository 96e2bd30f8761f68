"""Which matmuls run in fp8: a jaxpr rewrite that swaps selected ``dot_general``s for the fp8 one.

`convert(fn, recipe)` is the JAX counterpart of torchao's ``convert_to_float8_training``: it
traces `fn`, and every ``dot_general`` the filter selects runs through `jaxamp.fp8.dot_general`;
the rest runs as written. A selected matmul that cannot run in fp8 raises: nothing falls back to
high precision silently. `report` lists every matmul and whether it ran in fp8.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util

from jaxamp._numerics import over_array_leaves
from jaxamp.fp8._dot import (
    DelayedScalingState,
    check_hardware,
    dot_general,
    linear_like,
    to_2d,
)
from jaxamp.fp8._recipes import Recipe
from jaxamp.fp8._recipes import get_recipe as _fp8_recipe

__all__ = [
    "MatmulInfo",
    "MatmulOperands",
    "MatmulRecord",
    "AutocastFp8",
    "capture_operands",
    "combine_states",
    "convert",
    "init_state",
    "report",
    "select_state",
]

# Primitives whose sub-jaxpr runs once, in line: evaluated through the rewrite.
_INLINE = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
# Loops and branches: their bodies are re-traced through the rewrite (dynamic recipes).
_RETRACE = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",)}


@dataclasses.dataclass(frozen=True)
class MatmulInfo:
    """What a filter sees of one ``dot_general``: its module path and shapes.

    Attributes:
      name: unique name, the module path plus ``dot_general`` (``"#1"``, ``"#2"`` for repeats);
        the key of its delayed-scaling state.
      path: the module path from JAX's name stack (linen module names, ``jax.named_scope``), ``""``
        where there is none.
      lhs_shape, rhs_shape: operand shapes; lhs is the input, rhs the weight.
      dimension_numbers: as `jax.lax.dot_general`'s.
      dtype: the lhs dtype.
      linear: None if it is a linear layer's matmul (fp8-capable), else why not.

    Examples:
      A filter is called with one per matmul:

      >>> import jaxamp.fp8 as f8
      >>> seen = []
      >>> def fp8_filter(info):
      ...     seen.append((info.name, info.lhs_shape, info.rhs_shape, info.linear))
      ...     return True
      >>> loss = f8.convert(lambda x, w: x @ w, f8.get_recipe("tensorwise", emulate=True), fp8_filter=fp8_filter)
      >>> _ = jax.jit(loss)(jnp.ones((4, 8)), jnp.ones((8, 2)))
      >>> seen
      [('dot_general', (4, 8), (8, 2), None)]
    """

    name: str
    path: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    dimension_numbers: Any
    dtype: np.dtype
    linear: str | None


@dataclasses.dataclass(frozen=True)
class MatmulRecord:
    """One row of `report`: a matmul, whether it ran in fp8, how, and why not.

    Examples:
      >>> import jaxamp.fp8 as f8
      >>> (row,) = f8.report(lambda x, w: x @ w, jnp.ones((4, 8)), jnp.ones((8, 2)),
      ...                    recipe=f8.get_recipe("tensorwise", emulate=True))
      >>> row.name, row.lhs_shape, row.fp8, row.how
      ('dot_general', (4, 8), True, 'tensorwise, emulated (float32 matmul of fp8 values)')
    """

    name: str
    path: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    fp8: bool
    how: str

    def __str__(self) -> str:
        mark = "fp8" if self.fp8 else "hp "
        return f"{mark} {self.name:<40} {self.lhs_shape} x {self.rhs_shape}  {self.how}"


@dataclasses.dataclass(frozen=True)
class MatmulOperands:
    """The three tensors of one fp8 matmul as it received them (before quantization), 2-D.

    Attributes:
      input: ``(M, K)``: the input rows (leading dimensions flattened).
      weight: ``(K, N)``.
      grad_output: ``(M, N)``: the gradient flowing into the matmul's output.

    Examples:
      >>> import jaxamp.fp8 as f8
      >>> operands = f8.capture_operands(lambda w, x: jnp.sum(x @ w), jnp.ones((8, 2)),
      ...                                jnp.ones((4, 8)), recipe=f8.get_recipe("tensorwise", emulate=True))
      >>> found = operands["dot_general"]
      >>> found.input.shape, found.weight.shape, found.grad_output.shape
      ((4, 8), (8, 2), (4, 2))
    """

    input: jax.Array
    weight: jax.Array
    grad_output: jax.Array


def _check_selected(records: Sequence[MatmulRecord], fp8_filter: Any, caller: str) -> None:
    """Raises where an explicit `fp8_filter` selected no matmul: nothing would run in fp8."""
    if fp8_filter is None or any(r.fp8 for r in records):
        return
    if not records:
        raise ValueError(
            f"{caller}: fp8_filter={fp8_filter!r} selects nothing: the function has no matmul "
            "(dot_general) at all. Drop fp8=, or pass the function that holds the linear layers."
        )
    seen = sorted({r.path or r.name for r in records})
    hint = ""
    if isinstance(fp8_filter, str):
        close = difflib.get_close_matches(fp8_filter, seen, n=1, cutoff=0.3)
        hint = f" Closest path: {close[0]!r}." if close else ""
    raise ValueError(
        f"{caller}: fp8_filter={fp8_filter!r} selects none of the function's {len(records)} "
        f"matmuls, so nothing would run in fp8. The matmul paths it saw: {seen}.{hint} Globs "
        "match a matmul's module path (e.g. 'mlp/Dense_0') or its name (path + '/dot_general'); "
        "jaxamp.fp8.report lists them."
    )


def _default_filter(info: MatmulInfo) -> bool:
    return info.linear is None and jnp.issubdtype(info.dtype, jnp.floating)


def _selector(fp8_filter: Any) -> Callable[[MatmulInfo], bool]:
    if fp8_filter is None:
        return _default_filter
    if isinstance(fp8_filter, str):
        fp8_filter = (fp8_filter,)
    if isinstance(fp8_filter, Sequence) and all(isinstance(p, str) for p in fp8_filter):
        globs = tuple(fp8_filter)
        return lambda info: any(
            fnmatch.fnmatchcase(info.path, g) or fnmatch.fnmatchcase(info.name, g) for g in globs
        )
    if callable(fp8_filter):
        return fp8_filter
    raise TypeError(
        "fp8_filter must be None (every linear-layer matmul), a path glob or a list of globs "
        f"(e.g. 'decoder/*'), or a callable (MatmulInfo) -> bool; got {fp8_filter!r}."
    )


def _closed(sub: Any) -> tuple[Any, list]:
    if isinstance(sub, jex_core.ClosedJaxpr):
        return sub.jaxpr, list(sub.consts)
    return sub, []


def _stack_str(eqn: Any) -> str:
    return str(eqn.source_info.name_stack)


def _join(prefix: str, rest: str) -> str:
    return "/".join(p for p in (prefix, rest) if p)


# Other formats' recipes (jaxamp.mx) run through this rewrite too, registered as data by their
# package (`register_format`): this layer imports nothing above it. They bring a ``how`` line.
_FORMATS: dict[type, tuple[Callable, Callable]] = {}


def register_format(recipe_type: type, dot_general: Callable, check_hardware: Callable) -> None:
    """Lets this rewrite run another format's recipes: ``dot_general(lhs, rhs, dn,
    preferred_element_type=, recipe=)`` computes a matmul, ``check_hardware(recipe)`` refuses."""
    _FORMATS[recipe_type] = (dot_general, check_hardware)


def _format_of(rec: Any) -> tuple[Callable, Callable] | None:
    for recipe_type, functions in _FORMATS.items():
        if isinstance(rec, recipe_type):
            return functions
    return None


def _make_recipe(recipe: Any) -> Any:
    """A jaxamp.fp8 recipe (an object or a name), or a registered format's recipe as it is."""
    return recipe if _format_of(recipe) is not None else _fp8_recipe(recipe)


def _own_matmul(rec: Any) -> bool:
    return _format_of(rec) is not None


def _check_hardware(rec: Any) -> None:
    functions = _format_of(rec)
    if functions is not None:
        functions[1](rec)
    else:
        check_hardware(rec)


def _lowp_dot(rec: Any, lhs, rhs, dn, out_dtype, state=None):
    functions = _format_of(rec)
    if functions is not None:
        return functions[0](lhs, rhs, dn, preferred_element_type=out_dtype, recipe=rec)
    return dot_general(lhs, rhs, dn, preferred_element_type=out_dtype, recipe=rec, state=state)


class _Rewrite:
    def __init__(
        self,
        rec: Recipe,
        select: Callable,
        state: dict | None,
        records: list | None,
        capture: dict | None = None,
        taps: dict | None = None,
    ):
        self.capture = capture
        self.taps = taps
        self.recipe = rec
        self.select = select
        self.state = state
        self.records = records
        self.counts: dict[str, int] = {}
        self.used: list[str] = []

    # -- naming and selection -----------------------------------------------------------------

    def _info(self, eqn: Any, prefix: str, count: bool) -> MatmulInfo:
        path = _join(prefix, _stack_str(eqn))
        base = _join(path, "dot_general")
        n = self.counts.get(base, 0)
        if count:
            self.counts[base] = n + 1
        name = base if n == 0 else f"{base}#{n}"
        lhs, rhs = (v.aval for v in eqn.invars)
        dn = eqn.params["dimension_numbers"]
        return MatmulInfo(
            name=name,
            path=path,
            lhs_shape=tuple(lhs.shape),
            rhs_shape=tuple(rhs.shape),
            dimension_numbers=dn,
            dtype=np.dtype(lhs.dtype),
            linear=linear_like(dn, len(lhs.shape), len(rhs.shape)),
        )

    def _selects(self, info: MatmulInfo) -> bool:
        return bool(self.select(info))

    def _selected_inside(self, jaxpr: Any, prefix: str) -> list[str]:
        """Paths of selected matmuls anywhere inside `jaxpr` (without counting names)."""
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                info = self._info(eqn, prefix, count=False)
                if self._selects(info):
                    found.append(info.path or "dot_general")
            for sub in jex_core.jaxprs_in_params(eqn.params):
                found += self._selected_inside(sub, _join(prefix, _stack_str(eqn)))
        return found

    # -- evaluation ----------------------------------------------------------------------------

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], prefix: str, loop: str):
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            outs = self._eqn(eqn, vals, prefix, loop)
            for v, x in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jex_core.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _eqn(self, eqn: Any, vals: list, prefix: str, loop: str) -> list:
        name = eqn.primitive.name
        if name == "dot_general":
            return [self._dot(eqn, vals, prefix, loop)]
        inner_prefix = _join(prefix, _stack_str(eqn))
        if name in _INLINE and "jaxpr" in eqn.params:
            jaxpr, consts = _closed(eqn.params["jaxpr"])
            if self._selected_inside(jaxpr, inner_prefix):
                return self.eval(jaxpr, consts, vals, inner_prefix, loop)
        elif name in _RETRACE:
            subs = []
            for key in _RETRACE[name]:
                p = eqn.params[key]
                subs += list(p) if isinstance(p, tuple) else [p]
            if any(self._selected_inside(s.jaxpr, inner_prefix) for s in subs):
                return self._retrace(eqn, vals, inner_prefix)
        else:
            inside = []
            for sub in jex_core.jaxprs_in_params(eqn.params):
                inside += self._selected_inside(sub, inner_prefix)
            if inside:
                raise ValueError(
                    f"jaxamp.fp8: the matmul(s) at {sorted(set(inside))} are selected for fp8 but sit "
                    f"inside `{name}`, which the fp8 rewrite cannot enter (a custom derivative "
                    "rule would no longer match the fp8 forward). Exclude them with fp8_filter."
                )
        return _bind(eqn, vals, eqn.params)

    def _retrace(self, eqn: Any, vals: list, prefix: str) -> list:
        if self.recipe.scaling == "delayed":
            raise ValueError(
                f"jaxamp.fp8: a delayed-scaling matmul inside `{eqn.primitive.name}` (at "
                f"{prefix!r}) would share one amax history across iterations; use a dynamic "
                "recipe there, or exclude it with fp8_filter."
            )
        params = dict(eqn.params)

        def retrace(closed):
            def body(*args):
                return self.eval(closed.jaxpr, closed.consts, args, prefix, eqn.primitive.name)

            avals = [
                jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
                for v in closed.jaxpr.invars
            ]
            return jax.make_jaxpr(body)(*avals)

        for key in _RETRACE[eqn.primitive.name]:
            p = params[key]
            params[key] = tuple(retrace(b) for b in p) if isinstance(p, tuple) else retrace(p)
        return _bind(eqn, vals, params)

    def _dot(self, eqn: Any, vals: list, prefix: str, loop: str) -> Any:
        info = self._info(eqn, prefix, count=not loop)
        if not self._selects(info):
            self._record(info, False, "not selected by fp8_filter")
            return _bind(eqn, vals, eqn.params)[0]
        if info.linear is not None:
            raise ValueError(
                f"jaxamp.fp8: matmul {info.name!r} ({info.lhs_shape} x {info.rhs_shape}) is "
                f"selected for fp8 but {info.linear}. Exclude it with fp8_filter."
            )
        if not jnp.issubdtype(info.dtype, jnp.floating):
            raise ValueError(f"jaxamp.fp8: matmul {info.name!r} has {info.dtype} operands.")
        rec = self.recipe
        state = None
        if self.state is _COLLECT:  # init_state: names only, computed as written
            self._record(info, True, "collected")
            return _bind(eqn, vals, eqn.params)[0]
        if rec.scaling == "delayed":
            if self.state is None:
                raise ValueError(
                    "jaxamp.fp8: a delayed recipe needs fp8_state= (jaxamp.fp8.init_state)."
                )
            if info.name not in self.state:
                close = difflib.get_close_matches(info.name, list(self.state), n=1)
                hint = f" Closest: {close[0]!r}." if close else ""
                raise ValueError(
                    f"jaxamp.fp8: fp8_state has no entry {info.name!r}; it has "
                    f"{sorted(self.state)}.{hint} Build it with jaxamp.fp8.init_state."
                )
            state = self.state[info.name]
            self.used.append(info.name)
        lhs, rhs = vals
        out = _lowp_dot(
            rec, lhs, rhs, eqn.params["dimension_numbers"], eqn.outvars[0].aval.dtype, state
        )
        if self.capture is not None:
            out = self._capture(info.name, lhs, rhs, eqn.params["dimension_numbers"], out, loop)
        how = (
            rec.how
            if _own_matmul(rec)
            else f"{rec.name}, {'emulated (float32 matmul of fp8 values)' if rec.emulate else 'fp8 matmul'}"
        )
        self._record(info, True, how + (f", inside {loop}" if loop else ""))
        return out

    def _capture(self, name: str, lhs, rhs, dn, out, loop: str):
        """Keeps the matmul's 2-D operands and its grad_output (`capture_operands`).

        With ``taps`` None (the abstract pass) it notes the output's shape; else the operands
        stay in the program (outputs of `capture_operands`'s program) and the output passes
        through `_tap`, whose zero second argument's gradient is the grad_output. A matmul
        inside a loop (its values belong to the loop body) leaves through host callbacks, the
        last iteration's kept.
        """
        entry = self.capture.setdefault(name, {})
        (lc, _), _ = dn
        rows = int(np.prod([d for i, d in enumerate(lhs.shape) if i not in tuple(lc)]))
        x2, w2, _ = to_2d(lhs, rhs, dn)
        if self.taps is None:
            entry.update(out=jax.ShapeDtypeStruct(out.shape, out.dtype), loop=bool(loop))
            return out
        entry["rows"] = rows
        if name in self.taps:
            entry["lhs2d"], entry["rhs2d"] = x2, w2
            return _tap(out, self.taps[name])

        def keep(key: str):
            def store(*values):
                entry.update(zip(key.split(","), (np.asarray(v) for v in values), strict=True))

            return store

        jax.debug.callback(keep("lhs2d,rhs2d"), x2, w2)

        @jax.custom_vjp
        def tap(y):
            return y

        def tap_bwd(_, g):
            jax.debug.callback(keep("grad_output2d"), g.reshape(rows, -1))
            return (g,)

        tap.defvjp(lambda y: (y, None), tap_bwd)
        return tap(out)

    def _record(self, info: MatmulInfo, fp8: bool, how: str) -> None:
        if self.records is not None:
            self.records.append(
                MatmulRecord(info.name, info.path, info.lhs_shape, info.rhs_shape, fp8, how)
            )


def _bind(eqn: Any, vals: Sequence[Any], params: dict) -> list:
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]


_COLLECT: Any = object()  # state sentinel: collect the fp8 matmuls' names only


@jax.custom_vjp
def _tap(y: Any, zero: Any) -> Any:
    """`y` unchanged; the gradient of `zero` (zeros shaped as `y`) is `y`'s grad_output."""
    return y


_tap.defvjp(lambda y, zero: (y, None), lambda _, g: (g, g))


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) or hasattr(x, "aval")


def _run(fn, rec, fp8_filter, args, kwargs, state, records, capture=None, taps=None):
    rewrite = _Rewrite(rec, _selector(fp8_filter), state, records, capture, taps)
    flat_fn, dyn_vals = over_array_leaves(fn, args, kwargs, is_leaf_array=_is_array)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn_vals)
    outs = rewrite.eval(closed.jaxpr, closed.consts, dyn_vals, "", "")
    if state is not None and state is not _COLLECT:
        unused = sorted(set(state) - set(rewrite.used))
        if unused:
            raise ValueError(
                f"jaxamp.fp8: fp8_state entries {unused} match no fp8 matmul of this function "
                f"(it ran {sorted(rewrite.used)})."
            )
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)


def _abstract(f: Callable, args: tuple, kwargs: dict) -> None:
    """Trace ``f(args, kwargs)`` without computing: arrays abstract, other leaves static."""
    flat, dyn_vals = over_array_leaves(
        lambda *a, **k: f(a, k), args, kwargs, is_leaf_array=_is_array
    )
    jax.eval_shape(flat, *dyn_vals)


def convert(fn: Callable, recipe: Recipe | str = "tensorwise", *, fp8_filter: Any = None):
    """`fn` with its linear-layer matmuls in fp8 per `recipe` (torchao's ``convert_to_float8_training``).

    Args:
      fn: any JAX function (a loss, a model's apply).
      recipe: a `Recipe` or recipe name (see `jaxamp.fp8.get_recipe`).
      fp8_filter: which matmuls: None (every ``dot_general`` without batch dimensions, i.e.
        every linear layer; attention's batched matmuls stay as written, as torchao leaves them),
        a glob or list of globs on the module path / matmul name (``"*/mlp/*"``), or a callable
        ``(MatmulInfo) -> bool`` (by shape: ``lambda m: min(m.rhs_shape) >= 16``), like torchao's
        ``module_filter_fn``.

    Returns:
      A function with `fn`'s signature. With a delayed recipe it takes ``fp8_state=`` (a dict
      from `init_state`); differentiate with respect to that state to get the updated state.

    Raises:
      ValueError: at trace time, if a selected matmul cannot run in fp8 (batch dimensions,
        inside a custom-derivative function), an explicit `fp8_filter` selects no matmul (the
        error lists the paths seen), or the hardware has no fp8 matmuls and the recipe does not
        say ``emulate=True``. Nothing falls back to high precision silently.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxamp.fp8
      >>> f = jaxamp.fp8.convert(lambda x, w: jnp.tanh(x @ w), jaxamp.fp8.get_recipe("rowwise", emulate=True))
      >>> jax.jit(f)(jnp.ones((4, 8)), jnp.ones((8, 2))).shape
      (4, 2)
    """
    rec = _make_recipe(recipe)
    _selector(fp8_filter)  # validate early

    def wrapped(*args, fp8_state: dict | None = None, **kwargs):
        _check_hardware(rec)
        if rec.scaling != "delayed" and fp8_state is not None:
            raise ValueError("jaxamp.fp8: fp8_state is for delayed recipes only.")
        records: list[MatmulRecord] = []
        out = _run(fn, rec, fp8_filter, args, kwargs, fp8_state, records)
        _check_selected(records, fp8_filter, "jaxamp.fp8.convert")
        return out

    wrapped.__wrapped__ = fn
    wrapped.fp8_recipe = rec
    return wrapped


def report(
    fn: Callable,
    *args: Any,
    recipe: Recipe | str = "tensorwise",
    fp8_filter: Any = None,
    fp8_state: dict | None = None,
    **kwargs: Any,
) -> list[MatmulRecord]:
    """Every matmul of ``fn(*args, **kwargs)`` and whether it runs in fp8 under `recipe`.

    Traces only (no computation). A delayed recipe without `fp8_state` uses a fresh one.

    Returns:
      A list of `MatmulRecord` in program order (``str(record)`` is one line).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> rows = jaxamp.fp8.report(lambda x, w: x @ w, jnp.ones((4, 8)), jnp.ones((8, 2)),
      ...                          recipe=jaxamp.fp8.get_recipe("tensorwise", emulate=True))
      >>> [(r.name, r.fp8) for r in rows]
      [('dot_general', True)]
    """
    rec = _make_recipe(recipe)
    if rec.scaling == "delayed" and fp8_state is None:
        fp8_state = init_state(fn, rec, *args, fp8_filter=fp8_filter, **kwargs)
    records: list[MatmulRecord] = []
    _abstract(lambda a, k: _run(fn, rec, fp8_filter, a, k, fp8_state, records), args, kwargs)
    return records


def init_state(
    fn: Callable, recipe: Recipe | str, *args: Any, fp8_filter: Any = None, **kwargs: Any
) -> dict[str, DelayedScalingState]:
    """A fresh delayed-scaling state for every fp8 matmul of ``fn(*args, **kwargs)``.

    Returns:
      ``{matmul name: DelayedScalingState}`` (scales 1, histories 0, as Flax initialises them):
      an ordinary pytree to carry in the train state, checkpoint, and pass as ``fp8_state=``.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> r = jaxamp.fp8.get_recipe("delayed", emulate=True, amax_history_length=4)
      >>> list(jaxamp.fp8.init_state(lambda x, w: x @ w, r, jnp.ones((2, 3)), jnp.ones((3, 5))))
      ['dot_general']
    """
    rec = _make_recipe(recipe)
    if rec.scaling != "delayed":
        raise ValueError(f"jaxamp.fp8.init_state: recipe {rec.name!r} is not delayed.")
    names: list[str] = []

    def trace(a, k):
        records: list[MatmulRecord] = []
        _run(fn, rec, fp8_filter, a, k, _COLLECT, records)
        names.extend(r.name for r in records if r.fp8)

    _abstract(trace, args, kwargs)
    return {n: DelayedScalingState.create(rec.amax_history_length) for n in names}


def capture_operands(
    fn: Callable,
    *args: Any,
    recipe: Recipe | str = "tensorwise",
    fp8_filter: Any = None,
    fp8_state: dict | None = None,
    argnums: int = 0,
    **kwargs: Any,
) -> dict[str, MatmulOperands]:
    """The operands every fp8 matmul of ``fn(*args, **kwargs)`` receives, forward and backward.

    Runs ``fn`` (a scalar loss) converted per `recipe` and its gradient with respect to
    ``args[argnums]`` (one compiled program whose outputs are the operands) and keeps each
    selected matmul's input, weight and grad_output as 2-D arrays, before quantization: what a comparison of scales and fp8 codes against
    another framework (torchao's ``Float8Linear``) needs. Quantize them with
    `jaxamp.fp8.to_fp8_dynamic` and the recipe's casts.

    Args:
      fn: returns a scalar floating loss.
      *args, **kwargs: its arguments (concrete arrays: the operands come back as NumPy arrays).
      recipe, fp8_filter: as for `convert`.
      fp8_state: a delayed recipe's state (`init_state`); a fresh one if None.
      argnums: which positional argument the gradient is taken with respect to.

    Returns:
      ``{matmul name: MatmulOperands}`` for the matmuls that ran in fp8, in program order.

    Raises:
      ValueError: called under a transformation (``jit``, ``grad``), or `fp8_filter` selects
        nothing.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> rec = jaxamp.fp8.get_recipe("tensorwise", emulate=True)
      >>> ops = jaxamp.fp8.capture_operands(
      ...     lambda w, x: jnp.sum(x @ w), jnp.ones((8, 2)), jnp.ones((4, 8)), recipe=rec
      ... )
      >>> ops["dot_general"].input.shape, ops["dot_general"].weight.shape
      ((4, 8), (8, 2))
      >>> ops["dot_general"].grad_output.shape
      (4, 2)
    """
    rec = _make_recipe(recipe)
    _check_hardware(rec)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
        raise ValueError(
            "jaxamp.fp8.capture_operands returns concrete arrays: call it outside jit/grad/vmap."
        )
    if isinstance(argnums, bool) or not isinstance(argnums, int):
        raise TypeError(f"capture_operands(argnums=...) takes an int; got {argnums!r}.")
    if not -len(args) <= argnums < len(args):
        raise ValueError(
            f"capture_operands: argnums={argnums} but {len(args)} positional arguments given."
        )
    if rec.scaling == "delayed" and fp8_state is None:
        fp8_state = init_state(fn, rec, *args, fp8_filter=fp8_filter, **kwargs)
    index = argnums % len(args)
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [_is_array(x) for x in flat]
    dyn = [x for x, d in zip(flat, dynamic, strict=True) if d]

    def arguments(dyn_vals):
        """``(args, kwargs)`` with `dyn_vals` in the array leaves' places."""
        it = iter(dyn_vals)
        return jax.tree_util.tree_unflatten(
            treedef, [next(it) if d else x for x, d in zip(flat, dynamic, strict=True)]
        )

    def loss_of(dyn_vals, diff_arg, captured, taps, records):
        a, k = arguments(dyn_vals)
        full = list(a)
        full[index] = a[index] if diff_arg is None else diff_arg
        return _run(fn, rec, fp8_filter, tuple(full), k, fp8_state, records, captured, taps)

    # Which matmuls run in fp8 and their outputs' shapes: an abstract pass, nothing compiled.
    shapes: dict[str, dict] = {}
    jax.eval_shape(lambda v: loss_of(v, None, shapes, None, []), dyn)
    taps = {
        name: jnp.zeros(e["out"].shape, e["out"].dtype)
        for name, e in shapes.items()
        if not e["loop"]
    }
    captured: dict[str, dict] = {}
    records: list[MatmulRecord] = []

    def grad_of_loss(dyn_vals, taps):
        def loss(diff_arg, taps):
            value = loss_of(dyn_vals, diff_arg, captured, taps, records)
            return value, {n: (captured[n]["lhs2d"], captured[n]["rhs2d"]) for n in taps}

        (grads, grad_outputs), operands = jax.grad(loss, argnums=(0, 1), has_aux=True)(
            arguments(dyn_vals)[0][index], taps
        )
        # the gradient stays an output: without it XLA fuses the forward pass otherwise (a
        # LayerNorm's output moves by an ulp), and the operands are the gradient program's
        return operands, grad_outputs, grads

    # One compiled program whose outputs are the operands (cached as any program); only a
    # matmul inside a loop leaves through host callbacks.
    operands, grad_outputs, _ = jax.jit(grad_of_loss)(dyn, taps)
    operands, grad_outputs = jax.device_get((operands, grad_outputs))
    jax.effects_barrier()
    _check_selected(records, fp8_filter, "jaxamp.fp8.capture_operands")
    for name, (x2, w2) in operands.items():
        rows = captured[name]["rows"]
        captured[name].update(
            lhs2d=x2, rhs2d=w2, grad_output2d=np.asarray(grad_outputs[name]).reshape(rows, -1)
        )
    return {
        name: MatmulOperands(ops["lhs2d"], ops["rhs2d"], ops["grad_output2d"])
        for name, ops in captured.items()
    }


def select_state(applied: Any, new: Any, old: Any) -> Any:
    """`new` where the step was `applied`, else `old`: keeps fp8 state on a skipped step.

    Args:
      applied: a scalar bool (e.g. ``jaxamp.amp_info(opt_state).last_step_applied``).
      new, old: fp8 state pytrees of the same structure.

    Returns:
      The selected state (no host sync).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> jaxamp.fp8.select_state(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})["a"]
      Array([0., 0.], dtype=float32)
    """
    applied = jnp.asarray(applied, jnp.bool_)
    return jax.tree_util.tree_map(lambda n, o: jnp.where(applied, n, o), new, old)


def combine_states(*states: Any) -> Any:
    """Elementwise max of delayed-scaling states from micro-batches of one accumulation window.

    Every micro-batch starts from the same state, so their new scales agree and their
    histories differ only in the newest amax: the max is the state of the whole window.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.fp8
      >>> jaxamp.fp8.combine_states({"a": jnp.array([1., 5.])}, {"a": jnp.array([3., 2.])})["a"]
      Array([3., 5.], dtype=float32)
    """
    if not states:
        raise ValueError("jaxamp.fp8.combine_states: give at least one state.")
    return jax.tree_util.tree_map(lambda *xs: jnp.max(jnp.stack(xs), axis=0), *states)


class AutocastFp8:
    """fp8 for one ``jaxamp.autocast(fn, fp8=..., fp8_filter=...)``: the interpreter's hook.

    Each selected ``dot_general`` runs through `jaxamp.fp8.dot_general` on the operands autocast
    chose (e.g. bfloat16 under a bfloat16 autocast, as torchao's ``Float8Linear`` takes the
    autocast dtype), with autocast's output dtype. Dynamic recipes only: delayed scaling needs
    explicit state, so compose ``jaxamp.fp8.convert(jaxamp.autocast(fn), delayed_recipe)``.

    Args:
      recipe: a dynamic `Recipe` or its name.
      fp8_filter: as for `convert`.
      records: a list to append one `MatmulRecord` per matmul to, or None.
    """

    def __init__(self, recipe: Recipe | str, fp8_filter: Any = None, records: list | None = None):
        self.recipe = _make_recipe(recipe)
        if self.recipe.scaling == "delayed":
            raise ValueError(
                "autocast(fp8=...): delayed scaling carries explicit state; use "
                "jaxamp.fp8.convert(jaxamp.autocast(fn, ...), recipe, fp8_filter=...) with "
                "fp8_state= instead."
            )
        self.fp8_filter = fp8_filter
        self.select = _selector(fp8_filter)
        self.records = records
        self._counts: dict[str, int] = {}
        self._seen: list[MatmulRecord] = []

    @property
    def hooks(self) -> dict[str, Callable]:
        """``{"dot_general": hook}`` for ``jaxamp._autocast`` (see its interpreter's docstring)."""
        return {"dot_general": self._hook}

    def checked(self, fn: Callable) -> Callable:
        """`fn` (autocast with these hooks) numbering matmuls afresh per call, and raising where
        an explicit `fp8_filter` selected none of them (their paths named)."""

        def wrapped(*args, **kwargs):
            self._counts.clear()
            self._seen.clear()
            out = fn(*args, **kwargs)
            _check_selected(self._seen, self.fp8_filter, "autocast(fp8=...)")
            return out

        return wrapped

    def _note(self, record: MatmulRecord) -> None:
        self._seen.append(record)
        if self.records is not None:
            self.records.append(record)

    def _hook(self, call: Any) -> list | None:
        rec = self.recipe
        _check_hardware(rec)
        lhs, rhs = call.args
        dn = call.params["dimension_numbers"]
        path = call.name_stack
        base = _join(path, "dot_general")
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        info = MatmulInfo(
            name=base if n == 0 else f"{base}#{n}",
            path=path,
            lhs_shape=tuple(lhs.shape),
            rhs_shape=tuple(rhs.shape),
            dimension_numbers=dn,
            dtype=np.dtype(lhs.dtype),
            linear=linear_like(dn, lhs.ndim, rhs.ndim),
        )
        if not self.select(info):
            self._note(
                MatmulRecord(
                    info.name,
                    path,
                    info.lhs_shape,
                    info.rhs_shape,
                    False,
                    "not selected by fp8_filter",
                )
            )
            return None
        if info.linear is not None or not jnp.issubdtype(info.dtype, jnp.floating):
            raise ValueError(
                f"autocast(fp8=...): matmul {info.name!r} ({info.lhs_shape} x {info.rhs_shape}) "
                f"is selected for fp8 but {info.linear or 'its operands are not floating'}. "
                "Exclude it with fp8_filter."
            )
        out_dtype = call.params.get("preferred_element_type") or jnp.result_type(lhs, rhs)
        out = _lowp_dot(rec, lhs, rhs, dn, out_dtype)
        how = (
            rec.how
            if _own_matmul(rec)
            else f"{rec.name}, {'emulated' if rec.emulate else 'fp8 matmul'}"
        )
        how += ", under autocast"
        self._note(MatmulRecord(info.name, path, info.lhs_shape, info.rhs_shape, True, how))
        return [out]
