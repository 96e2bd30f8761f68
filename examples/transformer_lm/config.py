"""Configuration of the transformer LM example (configs as code)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters; every field can be overridden from the command line (see main.py).

    Attributes:
      precision: a jaxamp policy name; bf16-mixed by default (params and outputs float32,
        matmuls bfloat16, LayerNorm and the attention softmax float32).
      vocab_size, seq_len: the synthetic Markov-grammar language (parity.data.synthetic_tokens).
      d_model, num_heads, num_layers, mlp_ratio: the decoder-only transformer.
      batch_size, num_steps, learning_rate, warmup_steps, weight_decay, clip_norm: training.
      eval_every: steps between evaluations (and at the end).
      seed: data and init seed.
      progress: show a progress bar (only on a terminal).
    """

    precision: str = "bf16-mixed"
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4
    batch_size: int = 32
    num_steps: int = 300
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    eval_every: int = 100
    seed: int = 0
    progress: bool = True


def get_config(**overrides) -> Config:
    """The default config, with `overrides` applied."""
    return dataclasses.replace(Config(), **overrides)
