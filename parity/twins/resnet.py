"""`resnet`'s Flax twin (no torch here; `parity.models.resnet` pairs it with ``TorchResNet``
and describes the architecture and its ``wrong_port`` variants)."""

from __future__ import annotations

import difflib
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from parity.twins.layers import TorchBatchNorm

WRONG_PORTS = ("", "padding", "bn_variance")


def check_wrong_port(value: Any) -> str:
    if value not in WRONG_PORTS:
        close = difflib.get_close_matches(str(value), [w for w in WRONG_PORTS if w], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"get_model_pair('resnet'): `wrong_port` must be one of {WRONG_PORTS} ('' is the "
            f"correct port); got {value!r}.{hint}"
        )
    return value


def strides(config) -> list[int]:
    """Stride of every block, in order."""
    out = []
    for stage in range(len(config["channels"])):
        for block in range(config["blocks_per_stage"]):
            out.append(2 if stage > 0 and block == 0 else 1)
    return out


def block_channels(config) -> list[tuple[int, int]]:
    """(in, out) channels of every block, in order."""
    out = []
    previous = config["channels"][0]
    for channels in config["channels"]:
        for _ in range(config["blocks_per_stage"]):
            out.append((previous, channels))
            previous = channels
    return out


def _batch_norm(wrong_port: str, dtype: Any, param_dtype: Any, name: str):
    """``(x, train) -> y``: torch's BatchNorm, or flax.linen's for the ``bn_variance`` wrong port."""
    if wrong_port == "bn_variance":
        return lambda x, train: nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            use_fast_variance=False,
            dtype=dtype,
            param_dtype=param_dtype,
            name=name,
        )(x)
    return TorchBatchNorm(
        momentum=0.9, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype, name=name
    )


class FlaxBasicBlock(nn.Module):
    """The Flax twin of ``TorchBasicBlock`` (NHWC)."""

    out_channels: int
    stride: int
    has_shortcut: bool
    wrong_port: str = ""
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def _norm(self, name: str):
        return _batch_norm(self.wrong_port, self.dtype, self.param_dtype, name)

    def _conv(self, name: str, kernel: int, stride: int):
        if kernel == 3 and stride == 2 and self.wrong_port == "padding":
            padding: Any = "SAME"  # (0, 1) for an even input: the wrong port
        else:
            pad = (kernel - 1) // 2
            padding = ((pad, pad), (pad, pad))
        return nn.Conv(
            self.out_channels,
            (kernel, kernel),
            strides=(stride, stride),
            padding=padding,
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name=name,
        )

    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.relu(self._norm("bn1")(self._conv("conv1", 3, self.stride)(x), train))
        y = self._norm("bn2")(self._conv("conv2", 3, 1)(y), train)
        if self.has_shortcut:
            shortcut = self._norm("short_bn")(self._conv("short_conv", 1, self.stride)(x), train)
        else:
            shortcut = x
        return nn.relu(y + shortcut)


class FlaxResNet(nn.Module):
    """The Flax twin of ``TorchResNet`` (NHWC)."""

    channels: tuple[int, ...]
    blocks_per_stage: int
    num_classes: int
    wrong_port: str = ""
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images, train: bool = False):
        config = {"channels": self.channels, "blocks_per_stage": self.blocks_per_stage}
        x = nn.Conv(
            self.channels[0],
            (3, 3),
            padding=((1, 1), (1, 1)),
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="stem_conv",
        )(images)
        x = nn.relu(_batch_norm(self.wrong_port, self.dtype, self.param_dtype, "stem_bn")(x, train))
        for index, ((c_in, c_out), stride) in enumerate(
            zip(block_channels(config), strides(config), strict=True)
        ):
            x = FlaxBasicBlock(
                c_out,
                stride,
                stride != 1 or c_in != c_out,
                self.wrong_port,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=f"blocks_{index}",
            )(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(
            self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="fc"
        )(x)


def flax_model(config, dtype=None, param_dtype=jnp.float32) -> FlaxResNet:
    """The twin of `config` (the pair's configuration), wrong port included.

    Raises:
      ValueError: an unknown ``wrong_port``.
    """
    return FlaxResNet(
        tuple(config["channels"]),
        config["blocks_per_stage"],
        config["num_classes"],
        check_wrong_port(config["wrong_port"]),
        dtype=dtype,
        param_dtype=param_dtype,
    )
