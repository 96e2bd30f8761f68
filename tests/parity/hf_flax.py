"""Hugging Face Flax models for the tests, built with their random initialisation compiled as one
program.

``FlaxGPT2LMHeadModel(config, seed=0)`` runs its initialisers op by op: XLA compiles a program per
operation and shape, about 5 CPU seconds for a one-block GPT-2 the first time in a process. The
same initialisation under `jax.jit` compiles once (about 1 s, then shared by the compile cache).
Its normal draws can differ from the eager ones in the last bit (XLA fuses the scaling into the
draw); the tests never train from them: every pair takes the torch model's weights. Where a test
never reads them at all, ``weights="zeros"`` builds the model from the weights' shapes alone.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import jax
import numpy as np

__all__ = ["hf_flax_model"]


def hf_flax_model(cls: type, config: Any, *, seed: int = 0, weights: str = "random") -> Any:
    """``cls(config, seed=seed)`` (a Hugging Face Flax model class), its ``init_weights`` jitted
    while it is built (the class is left as it was).

    ``weights="zeros"``: the weights' shapes and dtypes only (``jax.eval_shape`` of the
    initialisation), as zero arrays: nothing is compiled. For a test whose Flax side takes the
    torch model's weights (a pair's transfer, a golden file's), where the model's own draws are
    never read."""
    if weights not in ("random", "zeros"):
        raise ValueError(f"hf_flax_model: `weights` must be 'random' or 'zeros'; got {weights!r}.")
    eager = cls.init_weights

    def init_weights(self, rng, input_shape, params=None):
        if params is not None:  # completing given weights (from_pretrained): as the class does
            return eager(self, rng, input_shape, params)
        if weights == "zeros":
            shapes = jax.eval_shape(lambda key: eager(self, key, input_shape), rng)
            return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
        return jax.jit(lambda key: eager(self, key, input_shape))(rng)

    with mock.patch.object(cls, "init_weights", init_weights):
        return cls(config, seed=seed)
