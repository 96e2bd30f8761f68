"""A torch model, its Flax port, and the weight transfer (with parity.transfer's layer functions).

This is the part a user writes when porting: the Flax twin mirrors the torch module layer for
layer (NHWC instead of NCHW), and `port_weights` copies every tensor across.
"""

from __future__ import annotations

import flax.linen as nn
import torch

from parity import transfer


class TorchNet(torch.nn.Module):
    """The model being ported: conv-relu-pool x2, a hidden layer with LayerNorm, a classifier."""

    def __init__(self, in_channels: int, image_size: int, channels, hidden: int, num_classes: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.feature_chw = (channels[1], image_size // 4, image_size // 4)
        c, h, w = self.feature_chw
        self.fc1 = torch.nn.Linear(c * h * w, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc2 = torch.nn.Linear(hidden, num_classes)

    def forward(self, images):  # NCHW
        x = self.pool(torch.relu(self.conv1(images)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.norm(self.fc1(x.flatten(1))))
        return self.fc2(x)


class FlaxNet(nn.Module):
    """The Flax port (NHWC). No dtype arguments: jaxamp's policy decides per module."""

    channels: tuple[int, int]
    hidden: int
    num_classes: int

    @nn.compact
    def __call__(self, images):
        x = images
        for name, features in (("conv1", self.channels[0]), ("conv2", self.channels[1])):
            x = nn.Conv(features, (3, 3), padding=((1, 1), (1, 1)), name=name)(x)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2), padding="VALID")
        x = x.reshape(x.shape[0], -1)
        x = nn.Dense(self.hidden, name="fc1")(x)
        x = nn.relu(nn.LayerNorm(epsilon=1e-5, name="norm")(x))
        return nn.Dense(self.num_classes, name="fc2")(x)


def port_weights(model: TorchNet) -> dict:
    """Flax variables holding `model`'s weights (float32)."""
    return {
        "params": {
            "conv1": transfer.conv_to_flax(model.conv1),
            "conv2": transfer.conv_to_flax(model.conv2),
            # torch flattens C,H,W; Flax H,W,C: permute the rows of the first dense kernel.
            "fc1": transfer.linear_to_flax(model.fc1, input_chw=model.feature_chw),
            "norm": transfer.layernorm_to_flax(model.norm),
            "fc2": transfer.linear_to_flax(model.fc2),
        }
    }
