"""Flax NNX layers whose numerics follow torch exactly where ``flax.nnx`` differs."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx


class TorchBatchNorm(nnx.Module):
    """``nnx.BatchNorm``'s variables (``scale``, ``bias``; ``BatchStat`` ``mean``, ``var``) with
    torch's running-variance update: the *unbiased* batch variance, as ``torch.nn.BatchNorm2d``
    (``nnx.BatchNorm`` uses the biased one, so eval-mode outputs drift by ``n / (n - 1)``).
    Normalises over every axis but the last, statistics in float32; ``.train()`` / ``.eval()``
    switch between batch and running statistics.

    Example:
      >>> bn = TorchBatchNorm(4, rngs=nnx.Rngs(0))
      >>> bn(jnp.ones((2, 3, 3, 4))).shape
      (2, 3, 3, 4)
    """

    def __init__(
        self,
        num_features: int,
        *,
        momentum: float = 0.9,
        epsilon: float = 1e-5,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        use_running_average: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs  # deterministic initialisation (ones / zeros), like torch
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype))
        self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))
        self.var = nnx.BatchStat(jnp.ones((num_features,), jnp.float32))
        self.momentum = momentum
        self.epsilon = epsilon
        self.dtype = dtype
        self.use_running_average = use_running_average

    def __call__(self, x):
        axes = tuple(range(x.ndim - 1))
        x32 = x.astype(jnp.float32)
        if self.use_running_average:
            mean, var = self.mean[...].astype(jnp.float32), self.var[...].astype(jnp.float32)
        else:
            mean = jnp.mean(x32, axis=axes)
            var = jnp.mean(jnp.square(x32 - mean), axis=axes)
            count = 1
            for axis in axes:
                count *= x.shape[axis]
            unbiased = var * jnp.float32(count / max(count - 1, 1))
            momentum = jnp.float32(self.momentum)
            old_mean = self.mean[...].astype(jnp.float32)
            old_var = self.var[...].astype(jnp.float32)
            self.mean[...] = (momentum * old_mean + (1 - momentum) * mean).astype(self.mean.dtype)
            self.var[...] = (momentum * old_var + (1 - momentum) * unbiased).astype(self.var.dtype)
        y = (x32 - mean) * jnp.reciprocal(jnp.sqrt(var + jnp.float32(self.epsilon)))
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype if self.dtype is not None else x.dtype)
