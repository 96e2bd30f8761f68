"""`transformer`'s Flax twin (no torch here; `parity.models.transformer` pairs it with
``TorchTransformerLM``)."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from parity.twins.layers import TorchLayerNorm

LN_EPS = 1e-5
KEYS = ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers", "mlp_ratio")


class FlaxBlock(nn.Module):
    d_model: int
    num_heads: int
    mlp_ratio: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask):
        kwargs = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        norm = functools.partial(TorchLayerNorm, epsilon=LN_EPS, **kwargs)
        h = norm(name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            qkv_features=self.d_model,
            out_features=self.d_model,
            deterministic=True,
            name="attn",
            **kwargs,
        )(h, h, mask=mask)
        x = x + h
        h = nn.Dense(self.mlp_ratio * self.d_model, name="fc1", **kwargs)(norm(name="ln2")(x))
        return x + nn.Dense(self.d_model, name="fc2", **kwargs)(nn.gelu(h, approximate=False))


class FlaxTransformerLM(nn.Module):
    """The Flax twin of ``TorchTransformerLM``."""

    vocab_size: int
    seq_len: int
    d_model: int
    num_heads: int
    num_layers: int
    mlp_ratio: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        kwargs = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        length = tokens.shape[1]
        x = nn.Embed(self.vocab_size, self.d_model, name="tok_embed", **kwargs)(tokens)
        x = (
            x
            + nn.Embed(self.seq_len, self.d_model, name="pos_embed", **kwargs)(
                jnp.arange(length, dtype=jnp.int32)
            )[None]
        )
        mask = nn.make_causal_mask(jnp.ones((1, length), dtype=jnp.int32), dtype=jnp.bool_)
        for index in range(self.num_layers):
            x = FlaxBlock(
                self.d_model, self.num_heads, self.mlp_ratio, name=f"blocks_{index}", **kwargs
            )(x, mask)
        x = TorchLayerNorm(epsilon=LN_EPS, name="ln_f", **kwargs)(x)
        return nn.Dense(self.vocab_size, name="head", **kwargs)(x)


def flax_model(config, dtype=None, param_dtype=jnp.float32) -> FlaxTransformerLM:
    """The twin of `config` (the pair's configuration).

    Raises:
      ValueError: ``d_model`` not divisible by ``num_heads``.
    """
    if config["d_model"] % config["num_heads"]:
        raise ValueError(
            f"`d_model` ({config['d_model']}) must be divisible by `num_heads` ({config['num_heads']})."
        )
    return FlaxTransformerLM(*(config[key] for key in KEYS), dtype=dtype, param_dtype=param_dtype)
