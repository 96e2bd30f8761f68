"""`mlp_nnx`: the `mlp` pair with a Flax NNX module on the JAX side.

The same torch model (``TorchMLP``) and the same parameter names (``fc1/fc2/fc3`` with
``kernel``/``bias``), so the mapping and the data are `mlp`'s; the Flax side is an
``nnx.Module`` wrapped by `parity.pairs.adapters.as_flax_model`, which presents it to the trainer as
``(variables, inputs, train) -> logits`` with plain ``{"params": ...}`` dicts.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from parity.models import mlp
from parity.pairs.adapters import as_flax_model

DEFAULTS: dict[str, Any] = dict(mlp.DEFAULTS)


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


def build(config, dtype, param_dtype):
    torch_model, _ = mlp.build(config, dtype, param_dtype)
    height, width, channels = config["image_shape"]

    def factory(dtype=None, param_dtype=jnp.float32):
        return NNXMLP(
            height * width * channels,
            config["hidden"],
            config["num_classes"],
            dtype=dtype,
            param_dtype=param_dtype if param_dtype is not None else jnp.float32,
            rngs=nnx.Rngs(0),  # overwritten by the torch weights
        )

    return torch_model, as_flax_model(factory(dtype, param_dtype), factory=factory)


to_flax = mlp.to_flax
from_flax = mlp.from_flax
mapping = mlp.mapping
make_data = mlp.make_data
