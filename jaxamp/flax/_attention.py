"""Dot-product attention with the softmax in float32 and the matmuls in the compute dtype.

torch on CUDA runs the two attention matmuls in float16/bfloat16 under autocast and the softmax
in float32 (its output is then cast back for the second matmul). Flax's `force_fp32_for_softmax`
(linen only) keeps the weights in float32 for the second matmul as well, and NNX has no such
switch; this function does what torch does, for both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["float32_softmax_attention"]


def _sow(module: Any, weights: jax.Array) -> None:
    from flax import linen, nnx

    if isinstance(module, linen.Module):
        module.sow("intermediates", "attention_weights", weights)
    elif isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)


def float32_softmax_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
) -> jax.Array:
    """A drop-in `attention_fn` for `nn.MultiHeadDotProductAttention` / `nnx.MultiHeadAttention`.

    Shapes as Flax's `dot_product_attention`: query ``[..., q, heads, depth]``, key/value
    ``[..., kv, heads, depth]``; returns ``[..., q, heads, depth]`` in the compute dtype
    (``dtype``, or the dtype query, key and value share).

    Args:
      query, key, value: the projected inputs.
      bias, mask: optional attention bias (added) and boolean mask (False: masked out).
      broadcast_dropout, dropout_rng, dropout_rate, deterministic: attention dropout, as Flax.
      dtype: the compute dtype (None: the common dtype of query/key/value).
      precision: matmul precision.
      module: if given, the float32 weights are sown as ``intermediates/attention_weights``.
      is_causal: apply a causal mask (NNX's argument).

    Returns:
      The attention output, in the compute dtype.

    Examples:
      >>> q = jnp.ones((1, 5, 2, 8), jnp.bfloat16)  # [batch, length, heads, depth]
      >>> jf.float32_softmax_attention(q, q, q).dtype
      dtype(bfloat16)
      >>> layer = nn.MultiHeadDotProductAttention(2, attention_fn=jf.float32_softmax_attention)
    """
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    depth = query.shape[-1]
    query = query / jnp.sqrt(jnp.asarray(depth, jnp.float32)).astype(dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    # Softmax in float32: exp of bfloat16/float16 logits loses the small weights.
    logits = logits.astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if is_causal:
        q_len, kv_len = logits.shape[-2], logits.shape[-1]
        causal = jnp.tril(jnp.ones((q_len, kv_len), jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    if module is not None:
        _sow(module, weights)
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(
                "float32_softmax_attention: dropout_rate > 0 and deterministic=False need a "
                "dropout_rng; got None."
            )
        keep_prob = 1.0 - dropout_rate
        shape = (
            tuple([1] * (key.ndim - 2)) + weights.shape[-2:] if broadcast_dropout else weights.shape
        )
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(jnp.float32) / jnp.float32(keep_prob))
    return jnp.einsum("...hqk,...khd->...qhd", weights.astype(dtype), value, precision=precision)
