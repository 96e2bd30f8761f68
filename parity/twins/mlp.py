"""`mlp`'s Flax twin (no torch here; `parity.models.mlp` pairs it with ``TorchMLP``)."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class FlaxMLP(nn.Module):
    """The Flax twin of ``TorchMLP``."""

    hidden: int
    num_classes: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images, train: bool = False):
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype)
        x = images.reshape(images.shape[0], -1)
        x = nn.relu(dense(self.hidden, name="fc1")(x))
        x = nn.relu(dense(self.hidden, name="fc2")(x))
        return dense(self.num_classes, name="fc3")(x)


def flax_model(config, dtype=None, param_dtype=jnp.float32) -> FlaxMLP:
    """The twin of `config` (the pair's configuration)."""
    return FlaxMLP(config["hidden"], config["num_classes"], dtype=dtype, param_dtype=param_dtype)
