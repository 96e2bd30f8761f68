"""Which matmuls run block-scaled: `convert`, `report` and `capture_operands` for `jaxamp.mx` recipes.

They are `jaxamp.fp8`'s matmul rewrite (the same selection by module path, refusals and report
rows) running `jaxamp.mx.dot_general` for each selected matmul. ``jaxamp.autocast(fn, fp8=r)``
takes a `jaxamp.mx` recipe ``r`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxamp.fp8._convert import MatmulOperands, MatmulRecord
from jaxamp.fp8._convert import capture_operands as _capture_operands
from jaxamp.fp8._convert import convert as _convert
from jaxamp.fp8._convert import report as _report
from jaxamp.mx._recipes import Recipe
from jaxamp.mx._recipes import get_recipe as _make_recipe

__all__ = ["capture_operands", "convert", "report"]


def convert(fn: Callable, recipe: Recipe | str = "mxfp8", *, mx_filter: Any = None) -> Callable:
    """`fn` with its linear-layer matmuls block-scaled per `recipe`.

    The JAX counterpart of swapping torch ``nn.Linear`` layers for torchao's ``MXFP8Linear``
    (or ``MXFP8TrainingOpConfig`` with ``quantize_``).

    Args:
      fn: any JAX function (a loss, a model's apply).
      recipe: a `jaxamp.mx.Recipe` or recipe name.
      mx_filter: which matmuls: None (every ``dot_general`` without batch dimensions), a glob or
        list of globs on the module path / matmul name (``"*/mlp/*"``), or a callable
        ``(jaxamp.fp8.MatmulInfo) -> bool`` (torchao's ``module_filter_fn``).

    Raises:
      ValueError: at trace time, where a selected matmul cannot run block-scaled (batch
        dimensions, a dimension not a multiple of the block size), an explicit `mx_filter`
        selects nothing, or the hardware has no block-scaled matmuls and the recipe does not
        say ``emulate=True``. Nothing falls back to high precision silently.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxamp.mx
      >>> f = jaxamp.mx.convert(lambda x, w: jnp.tanh(x @ w), jaxamp.mx.get_recipe("mxfp8", emulate=True))
      >>> jax.jit(f)(jnp.ones((32, 64)), jnp.ones((64, 32))).shape
      (32, 32)
    """
    return _convert(fn, _make_recipe(recipe), fp8_filter=mx_filter)


def report(
    fn: Callable, *args: Any, recipe: Recipe | str = "mxfp8", mx_filter: Any = None, **kwargs: Any
) -> list[MatmulRecord]:
    """Every matmul of ``fn(*args, **kwargs)`` and whether (and in which formats) it runs block-scaled.

    Traces only. Rows are `jaxamp.fp8.MatmulRecord`s: ``fp8`` is True for a block-scaled matmul,
    ``how`` names the recipe, its formats and scale modes.

    Examples:
      >>> import jax.numpy as jnp, jaxamp.mx
      >>> rows = jaxamp.mx.report(lambda x, w: x @ w, jnp.ones((32, 64)), jnp.ones((64, 32)),
      ...                         recipe=jaxamp.mx.get_recipe("mxfp8", emulate=True))
      >>> rows[0].how
      'mxfp8 (mxfp8/rceil), emulated (float32 matmul of dequantized blocks)'
    """
    return _report(fn, *args, recipe=_make_recipe(recipe), fp8_filter=mx_filter, **kwargs)


def capture_operands(
    fn: Callable,
    *args: Any,
    recipe: Recipe | str = "mxfp8",
    mx_filter: Any = None,
    argnums: int = 0,
    **kwargs: Any,
) -> dict[str, MatmulOperands]:
    """The input, weight and grad_output each block-scaled matmul of a loss receives (2-D, before
    quantization), as `jaxamp.fp8.capture_operands`: what a comparison of scales and codes
    against torchao needs (quantize them with `jaxamp.mx.to_block_scaled` and the recipe's formats).

    Examples:
      >>> import jax.numpy as jnp, jaxamp.mx
      >>> ops = jaxamp.mx.capture_operands(
      ...     lambda w, x: jnp.sum(x @ w), jnp.ones((64, 32)), jnp.ones((32, 64)),
      ...     recipe=jaxamp.mx.get_recipe("mxfp8", emulate=True))
      >>> ops["dot_general"].grad_output.shape
      (32, 32)
    """
    return _capture_operands(
        fn, *args, recipe=_make_recipe(recipe), fp8_filter=mx_filter, argnums=argnums, **kwargs
    )
