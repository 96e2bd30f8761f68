"""`mlp_nnx`'s Flax NNX twin (no torch here; `parity.models.mlp_nnx` pairs it with ``TorchMLP``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parity.pairs.adapters import FlaxModel, as_flax_model


class NNXMLP(nnx.Module):
    """Flatten -> Linear -> ReLU -> Linear -> ReLU -> Linear, in ``flax.nnx``."""

    def __init__(
        self, in_features: int, hidden: int, num_classes: int, *, dtype, param_dtype, rngs
    ):
        kwargs = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.fc1 = nnx.Linear(in_features, hidden, **kwargs)
        self.fc2 = nnx.Linear(hidden, hidden, **kwargs)
        self.fc3 = nnx.Linear(hidden, num_classes, **kwargs)

    def __call__(self, images):
        x = images.reshape(images.shape[0], -1)
        x = nnx.relu(self.fc1(x))
        x = nnx.relu(self.fc2(x))
        return self.fc3(x)


def flax_model(config, dtype=None, param_dtype=jnp.float32) -> FlaxModel:
    """The twin of `config` (the pair's configuration), wrapped with the factory that rebuilds
    it in another precision; its parameters are zeros until a pair's mapping sets them."""
    height, width, channels = config["image_shape"]

    def factory(dtype=None, param_dtype=jnp.float32):
        # The pair's weights are torch's (the mapping overwrites every parameter): the module is
        # built abstractly and filled with zeros on the host. NNX's own initialisers, run eagerly,
        # would compile a few XLA programs for every new layer shape, only to be overwritten.
        module = nnx.eval_shape(
            lambda: NNXMLP(
                height * width * channels,
                config["hidden"],
                config["num_classes"],
                dtype=dtype,
                param_dtype=param_dtype if param_dtype is not None else jnp.float32,
                rngs=nnx.Rngs(0),
            )
        )
        zeros = jax.tree.map(lambda s: jnp.asarray(np.zeros(s.shape, s.dtype)), nnx.state(module))
        nnx.update(module, zeros)
        return module

    return as_flax_model(factory(dtype, param_dtype), factory=factory)
