"""`lstm`'s Flax twin (no torch here; `parity.models.lstm` pairs it with ``TorchLSTMClassifier``)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from parity.twins.layers import TorchLSTM


class FlaxLSTMClassifier(nn.Module):
    """The Flax twin of ``TorchLSTMClassifier``: ``TorchLSTM`` keeps torch's two biases per gate
    (``b_ih`` and ``b_hh``), so both sides have the same parameters and AdamW updates them alike."""

    vocab_size: int
    embed_dim: int
    hidden: int
    num_classes: int
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        kwargs = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        x = nn.Embed(self.vocab_size, self.embed_dim, name="embed", **kwargs)(tokens)
        outputs = TorchLSTM(self.hidden, name="lstm", **kwargs)(x)
        return nn.Dense(self.num_classes, name="head", **kwargs)(jnp.mean(outputs, axis=1))


def flax_model(config, dtype=None, param_dtype=jnp.float32) -> FlaxLSTMClassifier:
    """The twin of `config` (the pair's configuration)."""
    args = (config["vocab_size"], config["embed_dim"], config["hidden"], config["num_classes"])
    return FlaxLSTMClassifier(*args, dtype=dtype, param_dtype=param_dtype)
