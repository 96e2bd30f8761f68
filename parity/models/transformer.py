"""`transformer`: a small decoder-only language model.

Token + learned position embeddings -> ``num_layers`` pre-LayerNorm blocks
(``x + attn(ln1(x))``, ``x + mlp(ln2(x))`` with causal multi-head attention and an exact-erf GELU
MLP) -> final LayerNorm -> linear head (not tied). LayerNorm eps is torch's 1e-5 on both sides;
the Flax side uses ``TorchLayerNorm`` (same params as ``flax.linen.LayerNorm``, float32 statistics,
runs in bfloat16 under strict dtype promotion).
"""

from __future__ import annotations

from typing import Any

import torch

from parity.data import synthetic_tokens
from parity.pairs import layer_entries
from parity.pairs.mapping import WeightMapping
from parity.twins import transformer as twin
from parity.twins.transformer import LN_EPS, FlaxBlock, FlaxTransformerLM  # noqa: F401

DEFAULTS: dict[str, Any] = {
    "vocab_size": 256,
    "seq_len": 64,
    "d_model": 64,
    "num_heads": 4,
    "num_layers": 2,
    "mlp_ratio": 4,
}

# Named sizes (``--size``): the architecture each name stands for.
# gpt2-small: GPT-2 small's shape (12 layers, 768 wide, 12 heads, context 1024) with a byte-level
# vocabulary (256, not GPT-2's 50,257 BPE tokens) and untied, learned embeddings and head:
# 86,235,904 parameters (85,054,464 in the 12 blocks); a training step (forward and backward)
# does 624.0 MFLOP of matmuls per token at context 1024 (forward 208.0 MFLOP: 2 x 85.1 M matmul
# weights plus the attention's two T x T products, 37.7 M), counted from the JAX program
# (`parity.perf.flops.jax_matmul_flops` of the gradient's and the forward pass's jaxprs).
SIZES: dict[str, dict[str, Any]] = {
    "gpt2-small": {
        "vocab_size": 256,
        "seq_len": 1024,
        "d_model": 768,
        "num_heads": 12,
        "num_layers": 12,
        "mlp_ratio": 4,
    },
}


class TorchBlock(torch.nn.Module):
    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d_model, eps=LN_EPS)
        self.attn = torch.nn.MultiheadAttention(d_model, num_heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d_model, eps=LN_EPS)
        self.fc1 = torch.nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = torch.nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        h, _ = self.attn(h, h, h, attn_mask=causal_mask, need_weights=False, is_causal=True)
        x = x + h
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TorchTransformerLM(torch.nn.Module):
    """Takes ``(B, T)`` token ids, ``T <= seq_len``; returns ``(B, T, vocab)`` logits."""

    def __init__(self, vocab_size, seq_len, d_model, num_heads, num_layers, mlp_ratio):
        super().__init__()
        self.tok_embed = torch.nn.Embedding(vocab_size, d_model)
        self.pos_embed = torch.nn.Embedding(seq_len, d_model)
        self.blocks = torch.nn.ModuleList(
            [TorchBlock(d_model, num_heads, mlp_ratio) for _ in range(num_layers)]
        )
        self.ln_f = torch.nn.LayerNorm(d_model, eps=LN_EPS)
        self.head = torch.nn.Linear(d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        x = self.tok_embed(tokens) + self.pos_embed(positions)[None]
        # True = not allowed to attend (future positions).
        causal_mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        for block in self.blocks:
            x = block(x, causal_mask)
        return self.head(self.ln_f(x))


def build(config, dtype, param_dtype):
    flax_model = twin.flax_model(config, dtype, param_dtype)  # checks the head count first
    return TorchTransformerLM(*(config[key] for key in twin.KEYS)), flax_model


def mapping(model: TorchTransformerLM, config) -> WeightMapping:
    entries = layer_entries.embedding_entries("tok_embed", "tok_embed", model.tok_embed)
    entries += layer_entries.embedding_entries("pos_embed", "pos_embed", model.pos_embed)
    for index, block in enumerate(model.blocks):
        prefix, flax = f"blocks.{index}", f"blocks_{index}"
        entries += layer_entries.norm_entries(f"{prefix}.ln1", f"{flax}/ln1", block.ln1)
        entries += layer_entries.attention_entries(f"{prefix}.attn", f"{flax}/attn", block.attn)
        entries += layer_entries.norm_entries(f"{prefix}.ln2", f"{flax}/ln2", block.ln2)
        entries += layer_entries.linear_entries(f"{prefix}.fc1", f"{flax}/fc1", block.fc1)
        entries += layer_entries.linear_entries(f"{prefix}.fc2", f"{flax}/fc2", block.fc2)
    entries += layer_entries.norm_entries("ln_f", "ln_f", model.ln_f)
    entries += layer_entries.linear_entries("head", "head", model.head)
    return WeightMapping(tuple(entries))


def make_data(config, seed: int, batch_size: int):
    return synthetic_tokens(seed, batch_size, config["seq_len"], config["vocab_size"], task="lm")
