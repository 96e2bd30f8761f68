"""`lstm`: a sentiment-style classifier over token ids.

Embedding -> one-layer LSTM (zero initial state) -> mean of the hidden states over time -> Linear.

The task (``parity.data.synthetic_tokens(task="classification")``): 32-token sequences of Markov
"text" in which about 15% of the positions are cue words, 75% of them from the labelled class and
25% from a random class; the model has to learn which of the 256 ids are cues, for which class,
and weigh the conflicting ones. Mean pooling lets every position's state reach the classifier
directly; classifying from the last state only learns the same task but sits at chance for the
first ~100 steps (the gradient has to find the cues through the whole recurrence).

Measured with ``python -m parity run --model lstm --precision fp32 --framework both --steps 300``
(CLI defaults: AdamW, lr 1e-3 with 10 warm-up steps, batch 32), both frameworks alike: loss
0.70 at the start, 0.65 around step 50, 0.48 around 100, 0.38 around 150, ~0.34 from 200 on,
eval accuracy 0.84. A 30-step matrix run is still near chance: it checks parity, not learning.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from parity.data import synthetic_tokens
from parity.pairs import layer_entries
from parity.pairs.mapping import WeightMapping
from parity.twins import lstm as twin
from parity.twins.lstm import FlaxLSTMClassifier  # noqa: F401  (the pair's Flax side)

DEFAULTS: dict[str, Any] = {
    "vocab_size": 256,
    "embed_dim": 32,
    "hidden": 64,
    "seq_len": 32,
    "num_classes": 2,
}


class TorchLSTMClassifier(torch.nn.Module):
    """Takes ``(B, T)`` integer token ids."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, num_classes: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, embed_dim)
        self.lstm = torch.nn.LSTM(embed_dim, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if _cpu_float16_autocast(x):
            # CPU autocast sends nn.LSTM to oneDNN, which has no float16 LSTM ("could not create a
            # primitive descriptor"). Do what autocast means: run the LSTM in float16 on float16
            # copies of the weights. The casts are differentiable, so gradients stay float32.
            with torch.autocast("cpu", enabled=False):
                weights = {name: p.half() for name, p in self.lstm.named_parameters()}
                outputs, _ = functional_call(self.lstm, weights, (x.half(),))
        else:
            outputs, _ = self.lstm(x)
        return self.head(outputs.mean(dim=1))


def _cpu_float16_autocast(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.float16
    )


def build(config, dtype, param_dtype):
    args = (config["vocab_size"], config["embed_dim"], config["hidden"], config["num_classes"])
    return TorchLSTMClassifier(*args), twin.flax_model(config, dtype, param_dtype)


def mapping(model: TorchLSTMClassifier, config) -> WeightMapping:
    entries = layer_entries.embedding_entries("embed", "embed", model.embed)
    entries += layer_entries.torch_lstm_entries("lstm", "lstm", model.lstm)
    entries += layer_entries.linear_entries("head", "head", model.head)
    return WeightMapping(tuple(entries))


def make_data(config, seed: int, batch_size: int):
    return synthetic_tokens(
        seed,
        batch_size,
        config["seq_len"],
        config["vocab_size"],
        task="classification",
        num_classes=config["num_classes"],
    )
