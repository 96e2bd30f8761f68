"""`mlp`: a 3-layer perceptron on flattened images (NHWC flattened the same way on both sides)."""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import torch

from parity import transfer
from parity.data import synthetic_images
from parity.pairs import layer_entries
from parity.pairs.mapping import WeightMapping

DEFAULTS: dict[str, Any] = {"image_shape": (32, 32, 3), "hidden": 128, "num_classes": 10}


class TorchMLP(torch.nn.Module):
    """Flatten -> Linear -> ReLU -> Linear -> ReLU -> Linear. Takes NHWC images."""

    def __init__(self, image_shape, hidden: int, num_classes: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(math.prod(image_shape), hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


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


def build(config, dtype, param_dtype):
    torch_model = TorchMLP(config["image_shape"], config["hidden"], config["num_classes"])
    flax_model = FlaxMLP(
        config["hidden"], config["num_classes"], dtype=dtype, param_dtype=param_dtype
    )
    return torch_model, flax_model


def to_flax(model: TorchMLP, config) -> dict:
    return {
        "params": {
            name: transfer.linear_to_flax(getattr(model, name)) for name in ("fc1", "fc2", "fc3")
        }
    }


def from_flax(variables, model: TorchMLP, config) -> None:
    for name in ("fc1", "fc2", "fc3"):
        transfer.linear_from_flax(variables["params"][name], getattr(model, name))


def mapping(model: TorchMLP, config) -> WeightMapping:
    entries = []
    for name in ("fc1", "fc2", "fc3"):
        entries += layer_entries.linear_entries(name, name, getattr(model, name))
    return WeightMapping(tuple(entries))


def make_data(config, seed: int, batch_size: int):
    return synthetic_images(seed, batch_size, tuple(config["image_shape"]), config["num_classes"])
