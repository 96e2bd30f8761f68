"""`resnet`: a small ResNet (BasicBlocks, BatchNorm, strided downsampling), torch and Flax.

stem: conv3x3(c0) -> BN -> ReLU; then one stage per entry of ``channels``, each of
``blocks_per_stage`` BasicBlocks (conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut, then
ReLU); the first block of every stage after the first has stride 2 and a 1x1 stride-2 conv + BN
shortcut (torchvision's ``downsample``); global average pool; Linear(num_classes). Convolutions
have no bias (BatchNorm follows each), as in torchvision.

This is the harness's chaotic test case: BatchNorm with a realistic AdamW learning rate amplifies
rounding differences from step to step, so a correct port can drift far apart within
a few steps, while its step-0 outputs and gradients agree to rounding.

``wrong_port`` builds a deliberately wrong Flax twin (the must-fail cases of the step-0 checks):

- ``"padding"``: every stride-2 3x3 conv uses Flax's ``padding="SAME"``, which pads ``(0, 1)``
  (all of the odd total at the end) where torch's ``padding=1`` pads ``(1, 1)``: same output
  shape, shifted sampling grid.
- ``"bn_variance"``: ``flax.linen.BatchNorm`` instead of
  :class:`parity.twins.layers.TorchBatchNorm`: the running variance is updated with the biased
  batch variance, where torch uses the unbiased one (``n / (n - 1)`` times larger).

Module names line up: torch ``blocks.1.conv1`` is Flax ``blocks_1/conv1``; ``stem_conv``,
``stem_bn`` and ``fc`` are the same on both sides.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.data import synthetic_images
from parity.pairs import layer_entries
from parity.pairs.mapping import WeightMapping
from parity.twins import resnet as twin
from parity.twins.resnet import (  # noqa: F401  (the pair's Flax side)
    WRONG_PORTS,
    FlaxBasicBlock,
    FlaxResNet,
    block_channels,
    check_wrong_port,
    strides,
)

DEFAULTS: dict[str, Any] = {
    "image_shape": (16, 16, 3),
    "channels": (8, 16, 32),
    "blocks_per_stage": 1,
    "num_classes": 10,
    "wrong_port": "",
}


# --- torch --------------------------------------------------------------------------------------


class TorchBasicBlock(torch.nn.Module):
    """conv3x3(stride) -> BN -> ReLU -> conv3x3 -> BN, + shortcut (1x1 conv + BN when the shape
    changes), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        conv = torch.nn.Conv2d
        self.conv1 = conv(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(out_channels)
        self.conv2 = conv(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(out_channels)
        self.has_shortcut = stride != 1 or in_channels != out_channels
        if self.has_shortcut:
            self.short_conv = conv(in_channels, out_channels, 1, stride=stride, bias=False)
            self.short_bn = torch.nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        shortcut = self.short_bn(self.short_conv(x)) if self.has_shortcut else x
        return torch.relu(y + shortcut)


class TorchResNet(torch.nn.Module):
    """Takes NCHW images (``ModelPair.torch_forward`` permutes the NHWC data)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        in_channels = config["image_shape"][2]
        stem = config["channels"][0]
        self.stem_conv = torch.nn.Conv2d(in_channels, stem, 3, padding=1, bias=False)
        self.stem_bn = torch.nn.BatchNorm2d(stem)
        self.blocks = torch.nn.ModuleList(
            TorchBasicBlock(c_in, c_out, stride)
            for (c_in, c_out), stride in zip(block_channels(config), strides(config), strict=True)
        )
        self.fc = torch.nn.Linear(config["channels"][-1], config["num_classes"])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # NCHW-contiguous: the permuted NHWC batch is channels-last in memory, and torch 2.13's
        # CPU weight gradient of a 1x1 stride-2 conv on channels-last input is wrong about half
        # the time (nondeterministic; found by the step-0 checks, see parity/verdicts/step0.py).
        x = torch.relu(self.stem_bn(self.stem_conv(images.contiguous())))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


# --- Flax ---------------------------------------------------------------------------------------


# --- the pair's hooks (see parity.models._Spec) -------------------------------------------------


def build(config, dtype, param_dtype):
    torch_model = TorchResNet(config)
    return torch_model, twin.flax_model(config, dtype, param_dtype)


def _norm_names(config) -> list[tuple[str, str]]:
    """(torch module path, Flax module name) of every conv and BN, in order."""
    names = [("stem_conv", "stem_conv"), ("stem_bn", "stem_bn")]
    for index, ((c_in, c_out), stride) in enumerate(
        zip(block_channels(config), strides(config), strict=True)
    ):
        layers = ["conv1", "bn1", "conv2", "bn2"]
        if stride != 1 or c_in != c_out:
            layers += ["short_conv", "short_bn"]
        names += [(f"blocks.{index}.{layer}", f"blocks_{index}/{layer}") for layer in layers]
    return names


def mapping(model: TorchResNet, config) -> WeightMapping:
    entries = []
    for torch_name, flax_name in _norm_names(config):
        layer = model.get_submodule(torch_name)
        if isinstance(layer, torch.nn.Conv2d):
            entries += layer_entries.conv_entries(torch_name, flax_name, layer)
        else:
            entries += layer_entries.norm_entries(torch_name, flax_name, layer)
    entries += layer_entries.linear_entries("fc", "fc", model.fc)
    return WeightMapping(tuple(entries))


def make_data(config, seed: int, batch_size: int):
    return synthetic_images(seed, batch_size, tuple(config["image_shape"]), config["num_classes"])
