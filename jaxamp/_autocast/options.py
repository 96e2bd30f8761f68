"""Argument checks for autocast's public functions: device, dtype and overrides."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jaxamp._autocast import oplists
from jaxamp._autocast.dtypes import F32
from jaxamp._autocast.oplists import AUTOCAST_CATEGORIES

DEVICES = ("cpu", "cuda")


def default_device() -> str:
    return "cuda" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"


def check_device(device: str | None) -> str:
    if device is None:
        return default_device()
    if device not in DEVICES:
        raise ValueError(
            f"autocast: `device` must be one of {DEVICES} (torch device types) or None for "
            f"JAX's default backend, got {device!r}."
        )
    return device


def check_dtype(dtype: Any, device: str) -> np.dtype:
    if dtype is None:
        return jnp.dtype(oplists.OP_LISTS[device].default_dtype)
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise TypeError(
            f"autocast: `dtype` must be a dtype (float16 or bfloat16) or None, got {dtype!r}."
        ) from err
    if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), F32):
        raise ValueError(
            f"autocast: `dtype` must be float16, bfloat16 or float32, got {dt.name}. "
            "torch.autocast supports the same (float32 makes lower-precision ops run in float32)."
        )
    return dt


@functools.cache
def primitive_names() -> frozenset[str]:
    """Names of JAX's own primitives (the keys `overrides` accepts besides torch op names)."""
    from jax.extend.core import primitives

    return frozenset(
        v.name for v in vars(primitives).values() if isinstance(v, jex_core.Primitive)
    ) | frozenset(p for prims in oplists.PRIMITIVE_COUNTERPARTS.values() for p in prims)


@functools.cache
def torch_op_names() -> frozenset[str]:
    """torch op names (with and without overload) that `overrides` accepts."""
    names = set(oplists.FUNCTION_COUNTERPARTS) | set(oplists.PRIMITIVE_COUNTERPARTS)
    for oplist in oplists.OP_LISTS.values():
        names.update(oplist.ops)
    return frozenset(names | {n.split(".")[0] for n in names})


def _unknown_key_error(name: str) -> ValueError:
    close = difflib.get_close_matches(
        name, sorted(primitive_names() | torch_op_names()), n=1, cutoff=0.6
    )
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return ValueError(
        f"autocast: unknown `overrides` key {name!r}{hint} Keys are JAX primitives or their "
        "names (dot_general, conv_general_dilated, exp, reduce_sum, ...: jaxamp.autocast_rules()"
        " lists those with rules) or torch op names from the op lists (linear, conv2d, "
        "softmax, layer_norm, ...: jaxamp.autocast_op_list(device).ops)."
    )


def check_overrides(
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
            close = difflib.get_close_matches(str(cat), AUTOCAST_CATEGORIES, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"autocast: `overrides[{name!r}]` must be one of {AUTOCAST_CATEGORIES} or None, "
                f"got {cat!r}{hint}."
            )
        if is_prim or name in primitive_names():
            prims[name] = cat
        elif name in torch_op_names():
            ops[name] = cat
        else:
            raise _unknown_key_error(name)
    return prims, ops
