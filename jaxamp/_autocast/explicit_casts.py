"""Explicit casts: user-written casts that JAX elides while tracing, made visible to autocast.

This is the one place where jaxamp touches JAX's functions. JAX leaves no trace of a cast to the
dtype a value already has (``lax.convert_element_type`` returns its operand unchanged before any
equation is recorded, so neither the jaxpr nor its params nor weak-type flags show it), and JAX
offers no hook to observe it. So, only while autocast traces ``fn`` and only on that thread's
calls from user code, ``Tracer.astype``, ``jnp.astype``/``asarray``/``array`` and
``lax.convert_element_type`` are wrapped to record such casts as no-op equations; the wrappers
are installed on entry, reference-counted across threads and removed on exit.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxamp._autocast.dtypes import CASTABLE, dtype_of, plain_dtype

__all__ = ["explicit_cast_p", "marking_explicit_casts"]

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

explicit_cast_p = jex_core.Primitive("jaxamp_explicit_cast")
explicit_cast_p.def_impl(lambda x, *, dtype: x)
explicit_cast_p.def_abstract_eval(lambda aval, *, dtype: aval)
mlir.register_lowering(explicit_cast_p, lambda ctx, x, *, dtype: [x])
ad.deflinear2(explicit_cast_p, lambda ct, x, *, dtype: [ct])
batching.defvectorized(explicit_cast_p)

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
    want = plain_dtype(dtype) if dtype is not None else None
    have = dtype_of(x)
    if want is None or have != want or want not in CASTABLE or dtype_of(out) != want:
        return out
    if getattr(out.aval, "weak_type", False) or getattr(x.aval, "weak_type", False):
        return out  # a weak -> strong cast is never elided: it is in the jaxpr already
    return explicit_cast_p.bind(out, dtype=want)


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


class marking_explicit_casts:
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
