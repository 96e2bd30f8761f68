"""dtype helpers shared by autocast's rules and interpreter: what is cast, and how."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Only these are ever cast, as torch casts only float16/bfloat16/float32 (never float64 or fp8).
CASTABLE = frozenset(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
F32 = jnp.dtype(jnp.float32)


def plain_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as a NumPy dtype, or None for an extended dtype (typed PRNG keys, ...).

    Extended dtypes are not NumPy dtypes (``np.dtype``/``jnp.dtype`` raise on them): every dtype
    helper goes through here, and autocast never casts such values.
    """
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    return jnp.dtype(dtype)


def dtype_of(x: Any) -> np.dtype | None:
    """The plain dtype of a value or aval; None without one or for extended dtypes."""
    return plain_dtype(getattr(x, "dtype", None))


def value_dtype_name(x: Any) -> str:
    """The dtype name of a value (``"bfloat16"``), as autocast's records print it."""
    return str(x.dtype)


def is_castable(x: Any) -> bool:
    return dtype_of(x) in CASTABLE


def cast(x: Any, dtype: np.dtype) -> Any:
    if not is_castable(x) or dtype_of(x) == dtype:
        return x
    return lax.convert_element_type(x, dtype)


def promote(dtypes: Sequence[np.dtype], weak: Sequence[bool]) -> np.dtype:
    """JAX's standard promotion restricted to floats, computed here so strict mode allows it."""
    strong = [d for d, w in zip(dtypes, weak, strict=False) if not w] or list(dtypes)
    if all(d == strong[0] for d in strong):
        return strong[0]
    if any(d == jnp.dtype(jnp.float64) for d in strong):
        return jnp.dtype(jnp.float64)
    # Any mix of float16, bfloat16 and float32 promotes to float32 in JAX (and in torch).
    return F32


def aval_dtype(atom: Any) -> np.dtype | None:
    return dtype_of(getattr(atom, "aval", None))
