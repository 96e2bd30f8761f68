"""Flax layers whose numerics follow torch exactly where flax.linen differs."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

Dtype = Any


class TorchBatchNorm(nn.Module):
    """BatchNorm over the last axis with torch's semantics and Flax's variable names.

    Same variables as ``flax.linen.BatchNorm`` (params ``scale``/``bias``, batch_stats
    ``mean``/``var``), but in training the running variance is updated with the *unbiased* batch
    variance, as ``torch.nn.BatchNorm2d`` does (``flax.linen.BatchNorm`` uses the biased one).
    Normalisation uses the biased variance in both. Statistics are computed in float32.

    Attributes:
      momentum: weight of the old running value (torch's ``1 - momentum``: 0.9 for torch's 0.1).
      epsilon: torch's ``eps``.
    """

    momentum: float = 0.9
    epsilon: float = 1e-5
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool):
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,), jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, (features,), jnp.float32)
        axes = tuple(range(x.ndim - 1))
        x32 = x.astype(jnp.float32)
        if train:
            mean = jnp.mean(x32, axis=axes)
            var = jnp.mean(jnp.square(x32 - mean), axis=axes)
            if not self.is_initializing():
                count = 1
                for axis in axes:
                    count *= x.shape[axis]
                unbiased = var * jnp.float32(count / max(count - 1, 1))
                momentum = jnp.float32(self.momentum)
                # In float32 whatever the stored dtype (a bf16-true run may store bf16 stats).
                old_mean = ra_mean.value.astype(jnp.float32)
                old_var = ra_var.value.astype(jnp.float32)
                new_mean = momentum * old_mean + (1 - momentum) * mean
                new_var = momentum * old_var + (1 - momentum) * unbiased
                ra_mean.value = new_mean.astype(ra_mean.value.dtype)
                ra_var.value = new_var.astype(ra_var.value.dtype)
        else:
            mean = ra_mean.value.astype(jnp.float32)
            var = ra_var.value.astype(jnp.float32)
        y = (x32 - mean) * jnp.reciprocal(jnp.sqrt(var + jnp.float32(self.epsilon)))
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype if self.dtype is not None else x.dtype)


class TorchLayerNorm(nn.Module):
    """LayerNorm over the last axis, computed in float32, torch's default ``eps=1e-5``.

    Same parameters as ``flax.linen.LayerNorm`` (``scale``, ``bias``), so
    ``parity.transfer.layernorm_to_flax`` applies. Unlike ``flax.linen.LayerNorm`` it runs in
    bfloat16/float16 under ``jax_numpy_dtype_promotion="strict"`` (flax promotes the input dtype
    implicitly to float32 there, which strict mode rejects). Output dtype: ``dtype`` if given,
    else the input's.
    """

    epsilon: float = 1e-5
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jnp.reciprocal(jnp.sqrt(var + jnp.float32(self.epsilon)))
        y = y * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return y.astype(self.dtype if self.dtype is not None else x.dtype)
