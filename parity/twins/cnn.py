"""`cnn` / `cnn_bn`'s Flax twin (no torch here; `parity.models.cnn` pairs it with ``TorchCNN``)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from parity.twins.layers import TorchBatchNorm

_CONVS = ("conv1", "conv2")
_NORMS = ("bn1", "bn2")


class FlaxCNN(nn.Module):
    """The Flax twin of ``TorchCNN`` (NHWC)."""

    channels: tuple[int, int]
    num_classes: int
    batch_norm: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images, train: bool = False):
        x = images
        for conv_name, norm_name, features in zip(_CONVS, _NORMS, self.channels, strict=True):
            x = nn.Conv(
                features,
                (3, 3),
                padding=((1, 1), (1, 1)),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                name=conv_name,
            )(x)
            if self.batch_norm:
                x = TorchBatchNorm(
                    momentum=0.9,
                    epsilon=1e-5,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                    name=norm_name,
                )(x, train)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2), padding="VALID")
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(
            self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, name="fc"
        )(x)


def flax_model(config, dtype=None, param_dtype=jnp.float32) -> FlaxCNN:
    """The twin of `config` (the pair's configuration)."""
    return FlaxCNN(
        tuple(config["channels"]),
        config["num_classes"],
        config["batch_norm"],
        dtype=dtype,
        param_dtype=param_dtype,
    )
