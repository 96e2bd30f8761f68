"""`cnn` / `cnn_bn`: the classic small CIFAR-10 net.

conv3x3(32) [-> BatchNorm] -> ReLU -> maxpool2 -> conv3x3(64) [-> BatchNorm] -> ReLU -> maxpool2 ->
flatten -> Linear(num_classes). Convs pad by 1, pooling floors (torch ``MaxPool2d(2)`` = Flax
``max_pool`` with VALID padding). torch flattens C,H,W and Flax H,W,C: the transfer permutes the
linear layer's input rows.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.data import synthetic_images
from parity.pairs import layer_entries
from parity.pairs.mapping import WeightMapping
from parity.twins import cnn as twin
from parity.twins.cnn import FlaxCNN  # noqa: F401  (the pair's Flax side)

DEFAULTS: dict[str, Any] = {
    "image_shape": (32, 32, 3),
    "channels": (32, 64),
    "num_classes": 10,
    "batch_norm": False,
}
BN_DEFAULTS: dict[str, Any] = {**DEFAULTS, "batch_norm": True}
_CONVS = ("conv1", "conv2")
_NORMS = ("bn1", "bn2")


def _feature_chw(config) -> tuple[int, int, int]:
    height, width, _ = config["image_shape"]
    return (config["channels"][1], height // 2 // 2, width // 2 // 2)


class TorchCNN(torch.nn.Module):
    """Takes NCHW images (``ModelPair.torch_forward`` permutes the NHWC data)."""

    def __init__(self, image_shape, channels, num_classes: int, batch_norm: bool):
        super().__init__()
        in_channels = image_shape[2]
        self.conv1 = torch.nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(channels[0]) if batch_norm else torch.nn.Identity()
        self.bn2 = torch.nn.BatchNorm2d(channels[1]) if batch_norm else torch.nn.Identity()
        self.pool = torch.nn.MaxPool2d(2)
        c, h, w = channels[1], image_shape[0] // 4, image_shape[1] // 4
        self.fc = torch.nn.Linear(c * h * w, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(images))))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        return self.fc(x.flatten(1))


def build(config, dtype, param_dtype):
    torch_model = TorchCNN(
        config["image_shape"], config["channels"], config["num_classes"], config["batch_norm"]
    )
    return torch_model, twin.flax_model(config, dtype, param_dtype)


def mapping(model: TorchCNN, config) -> WeightMapping:
    entries = []
    for index, name in enumerate(_CONVS):
        entries += layer_entries.conv_entries(name, name, getattr(model, name))
        if config["batch_norm"]:
            norm = _NORMS[index]
            entries += layer_entries.norm_entries(norm, norm, getattr(model, norm))
    entries += layer_entries.linear_entries("fc", "fc", model.fc, input_chw=_feature_chw(config))
    return WeightMapping(tuple(entries))


def make_data(config, seed: int, batch_size: int):
    return synthetic_images(seed, batch_size, tuple(config["image_shape"]), config["num_classes"])
