"""`mlp`: a 3-layer perceptron on flattened images (NHWC flattened the same way on both sides)."""

from __future__ import annotations

import math
from typing import Any

import torch

from parity.data import synthetic_images
from parity.pairs import layer_entries
from parity.pairs.mapping import WeightMapping
from parity.twins import mlp as twin
from parity.twins.mlp import FlaxMLP  # noqa: F401  (the pair's Flax side)

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


def build(config, dtype, param_dtype):
    torch_model = TorchMLP(config["image_shape"], config["hidden"], config["num_classes"])
    return torch_model, twin.flax_model(config, dtype, param_dtype)


def mapping(model: TorchMLP, config) -> WeightMapping:
    entries = []
    for name in ("fc1", "fc2", "fc3"):
        entries += layer_entries.linear_entries(name, name, getattr(model, name))
    return WeightMapping(tuple(entries))


def make_data(config, seed: int, batch_size: int):
    return synthetic_images(seed, batch_size, tuple(config["image_shape"]), config["num_classes"])
