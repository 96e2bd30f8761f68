"""Flax layers whose numerics follow torch exactly where flax.linen differs."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
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


class TorchLSTM(nn.Module):
    """One ``torch.nn.LSTM`` layer (unidirectional, ``batch_first``) with torch's parameterisation.

    torch keeps two bias vectors per gate, ``b_ih`` and ``b_hh``; ``flax.linen``'s LSTM cells keep
    one. The forward pass only sees their sum, but an optimizer does not: AdamW moves each torch
    bias by about ``lr`` per step, so their sum moves twice as far as a single Flax bias and fp32
    training diverges from the first step. This layer keeps both, so the parameters, their
    gradients and AdamW's updates match torch's one for one (``parity.transfer.torch_lstm_to_flax``
    / ``torch_lstm_from_flax``).

    Parameters (gate order ``i, f, g, o`` along the last axis, as torch's rows)::

        kernel_ih (in, 4H)   = weight_ih_l0.T      bias_ih (4H,) = bias_ih_l0
        kernel_hh (H, 4H)    = weight_hh_l0.T      bias_hh (4H,) = bias_hh_l0

    The cell is torch's: ``gates = x W_ih + b_ih + h W_hh + b_hh``,
    ``c' = sigmoid(f) c + sigmoid(i) tanh(g)``, ``h' = sigmoid(o) tanh(c')``, from a zero carry. The
    input projection is computed for all time steps at once; the recurrence is a plain
    ``jax.lax.scan`` over the time axis (no PRNG keys, no lifted transforms), so
    ``jaxamp.autocast`` sees ordinary matmuls inside a scan body. Initialisation is torch's:
    every parameter uniform in ``[-1/sqrt(H), 1/sqrt(H)]``.

    Takes ``(B, T, in)``; returns the outputs ``(B, T, H)`` (every step's ``h``), or
    ``((c_T, h_T), outputs)`` with ``return_carry=True`` (``flax.linen.RNN``'s convention).
    Computes in ``dtype`` if given, else in the promoted dtype of input and parameters.
    """

    features: int
    use_bias: bool = True
    return_carry: bool = False
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        hidden = self.features
        bound = 1.0 / float(hidden) ** 0.5

        def init(key, shape, dtype):
            return jax.random.uniform(key, shape, dtype, -bound, bound)

        kernel_ih = self.param("kernel_ih", init, (x.shape[-1], 4 * hidden), self.param_dtype)
        kernel_hh = self.param("kernel_hh", init, (hidden, 4 * hidden), self.param_dtype)
        if self.use_bias:
            bias_ih = self.param("bias_ih", init, (4 * hidden,), self.param_dtype)
            bias_hh = self.param("bias_hh", init, (4 * hidden,), self.param_dtype)
            x, kernel_ih, kernel_hh, bias_ih, bias_hh = nn.dtypes.promote_dtype(
                x, kernel_ih, kernel_hh, bias_ih, bias_hh, dtype=self.dtype
            )
        else:
            x, kernel_ih, kernel_hh = nn.dtypes.promote_dtype(
                x, kernel_ih, kernel_hh, dtype=self.dtype
            )
            bias_ih = bias_hh = None

        # (B, T, in) -> time-major input projections (T, B, 4H), one matmul for all steps.
        projected = jnp.einsum("bti,ig->tbg", x, kernel_ih)
        if bias_ih is not None:
            projected = projected + bias_ih

        def step(carry, projected_t):
            c, h = carry
            gates = projected_t + h @ kernel_hh
            if bias_hh is not None:
                gates = gates + bias_hh
            i, f, g, o = jnp.split(gates, 4, axis=-1)
            c = nn.sigmoid(f) * c + nn.sigmoid(i) * jnp.tanh(g)
            h = nn.sigmoid(o) * jnp.tanh(c)
            return (c, h), h

        zeros = jnp.zeros((x.shape[0], hidden), projected.dtype)
        carry, outputs = jax.lax.scan(step, (zeros, zeros), projected)
        outputs = jnp.swapaxes(outputs, 0, 1)
        return (carry, outputs) if self.return_carry else outputs
