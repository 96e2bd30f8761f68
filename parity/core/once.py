"""How the harness compiles a program it runs once (step 0's sides, the layer probe, the
diagnosis's per-layer pass): without XLA:GPU's autotuning.

On a GPU, XLA autotunes each program it compiles: it builds candidate kernels for every matmul
and fusion on all host cores and times them on the device. That pays for a training step run
thousands of times; for a program run once it is the whole cost. On an NVIDIA H200 (jax 0.11.2),
GPT-2 small's step 0 spent 47-53 s wall and 137-166 s of host CPU in the layer probe (one
program), and its gradient program had not finished compiling 40 s later. With autotuning off,
XLA takes its default kernel for each operation (cuBLAS for the matmuls), which computes the same
function; the tolerances of these checks do not depend on which kernel XLA picks. The option is
one of XLA's compile options on every platform (ignored off GPU), so the same program is built
the same way everywhere. The train step keeps XLA's defaults: its speed is measured.

Example:
  >>> import jax, jax.numpy as jnp
  >>> once_jit(lambda x: x @ x)(jnp.ones((2, 2))).tolist()
  [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["ONCE", "once_jit"]

# XLA compile options of a program the harness runs once.
ONCE: dict[str, Any] = {"xla_gpu_autotune_level": 0}


def once_jit(fun: Callable, **kwargs: Any) -> Any:
    """`jax.jit` with the `ONCE` compile options (`kwargs` as `jax.jit`'s)."""
    return jax.jit(fun, compiler_options=ONCE, **kwargs)
