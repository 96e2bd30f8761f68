"""The harness tested by mutation: known porting bugs applied to the built-in pairs must never pass.

Each mutation changes one side of a correct pair the way a real port goes wrong (an activation
variant, an epsilon, a padding, a missing ReLU, two same-shape layers swapped, a dropped bias, an
attention scale, a causal mask, a position offset, dropout left on, an untransposed weight, a
recurrent gate order...). Each must make step 0 fail: the row that catches it is named in the
catalogue below (README "What a PASS means" shows the same table), and the probe row is part of
step 0's float32 stage at every precision, so a mutation it catches fails fp32 and bf16-mixed
alike. The catalogue's correct ports pass (tests/parity/test_parity_golden_mutations.py).

Tiny shapes, torch on one thread: the whole module stays within a few seconds per pair.
"""

from __future__ import annotations

import dataclasses
import types

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_flax import hf_flax_model

from parity import api
from parity.core.config import RunConfig
from parity.models import get_model_pair
from parity.pairs import adapters, dropout
from parity.twins import transformer as transformer_module
from parity.verdicts.layer_probe import probe_layers
from parity.verdicts.step0 import check_step0
from parity.verdicts.step0_checks import PROBE_CHECK, STOCHASTIC_CHECK, stochastic_verdict

SMALL = {
    "mlp": {"image_shape": (4, 4, 3), "hidden": 8},
    "mlp_nnx": {"image_shape": (4, 4, 3), "hidden": 8},
    "cnn_bn": {"image_shape": (8, 8, 3), "channels": (4, 8)},
    "resnet": {"image_shape": (8, 8, 3), "channels": (4, 8, 8)},
    "lstm": {"seq_len": 6, "hidden": 8, "embed_dim": 8},
    "transformer": {"seq_len": 8, "d_model": 16, "num_heads": 2, "num_layers": 1},
}
BATCH = 4

# Tiny layers: torch on one thread (extra ones only contend on a shared 2-core runner).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pair(model: str, **overrides):
    if model == "gru":
        return _gru_pair()
    return get_model_pair(model, seed=0, **{**SMALL[model], **overrides})


def _batch(pair):
    if pair.data is None:
        return _gru_batch()
    return pair.make_data(0, BATCH).batch(0)


def _with_transfer(pair, edit):
    """The pair with its torch -> Flax transfer edited (a porting bug in the weight mapping)."""
    original = pair.to_flax

    def to_flax(model):
        variables = jax.tree.map(np.array, original(model))
        edit(variables)
        return variables

    return dataclasses.replace(pair, to_flax=to_flax)


# --- the mutations: (model, what changes, the check that must catch it) ------------------------


def _gelu_tanh(monkeypatch, pair):
    monkeypatch.setattr(fnn, "gelu", lambda x, approximate=True: jax.nn.gelu(x, approximate=True))
    return pair


def _layernorm_eps(monkeypatch, pair):
    monkeypatch.setattr(transformer_module, "LN_EPS", 1e-6)  # Flax reads it at call time
    return pair


def _batchnorm_eps(monkeypatch, pair):
    pair.torch_model.bn1.eps = 1e-3
    return pair


def _batchnorm_momentum(monkeypatch, pair):
    pair.torch_model.bn2.momentum = 0.01
    return pair


def _missing_relu(monkeypatch, pair):
    monkeypatch.setattr(fnn, "relu", lambda x: x)
    return pair


def _swapped_layernorms(monkeypatch, pair):
    def edit(variables):
        block = variables["params"]["blocks_0"]
        block["ln1"], block["ln2"] = block["ln2"], block["ln1"]

    return _with_transfer(pair, edit)


def _dropped_bias(monkeypatch, pair):
    def edit(variables):  # torch initialises it to zero: only the probe's offsets show it
        bias = variables["params"]["blocks_0"]["attn"]["out"]["bias"]
        variables["params"]["blocks_0"]["attn"]["out"]["bias"] = np.zeros_like(bias)

    return _with_transfer(pair, edit)


def _attention_scale(monkeypatch, pair):
    original = fnn.attention.dot_product_attention_weights

    def unscaled(query, key, *args, **kwargs):  # no 1/sqrt(head_dim)
        return original(query * jnp.sqrt(jnp.float32(query.shape[-1])), key, *args, **kwargs)

    monkeypatch.setattr(fnn.attention, "dot_product_attention_weights", unscaled)
    return pair


def _causal_mask_off(monkeypatch, pair):
    original = fnn.make_causal_mask
    monkeypatch.setattr(fnn, "make_causal_mask", lambda x, **kw: jnp.ones_like(original(x, **kw)))
    return pair


def _position_offset(monkeypatch, pair):
    model = pair.torch_model

    def forward(self, tokens):  # positions 1..T (wrapping), where Flax counts from 0
        length = tokens.shape[1]
        positions = (torch.arange(length) + 1) % length
        x = self.tok_embed(tokens) + self.pos_embed(positions)[None]
        mask = torch.ones(length, length, dtype=torch.bool).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    model.forward = types.MethodType(forward, model)
    return pair


def _untransposed_weight(monkeypatch, pair):
    def edit(variables):
        kernel = variables["params"]["fc2"]["kernel"]
        variables["params"]["fc2"]["kernel"] = np.ascontiguousarray(kernel.T)

    return _with_transfer(pair, edit)


def _lstm_gate_order(monkeypatch, pair):
    def edit(variables):  # torch's rows are i, f, g, o: a port that reads them as f, i, g, o
        lstm = variables["params"]["lstm"]
        for name in ("kernel_ih", "kernel_hh", "bias_ih", "bias_hh"):
            i, f, g, o = np.split(lstm[name], 4, axis=-1)
            lstm[name] = np.concatenate([f, i, g, o], axis=-1)

    return _with_transfer(pair, edit)


def _lstm_dropped_hidden_bias(monkeypatch, pair):
    def edit(variables):
        lstm = variables["params"]["lstm"]
        lstm["bias_hh"] = np.zeros_like(lstm["bias_hh"])

    return _with_transfer(pair, edit)


def _lstm_tanh_cell(monkeypatch, pair):
    monkeypatch.setattr(fnn, "sigmoid", jnp.tanh)  # a gate activation variant
    return pair


class _TorchGRU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.gru = torch.nn.GRU(4, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, tokens):
        outputs, _ = self.gru(self.embed(tokens))
        return self.head(outputs.mean(dim=1))


class _FlaxGRU(fnn.Module):
    """``flax.linen.RNN(GRUCell)``: forward-exact against ``torch.nn.GRU``, but its mapping folds
    torch's two input-gate biases into one."""

    @fnn.compact
    def __call__(self, tokens, train: bool = False):
        h = fnn.Embed(16, 4, name="embed")(tokens)
        h = fnn.RNN(fnn.GRUCell(6), name="gru")(h)
        return fnn.Dense(3, name="head")(jnp.mean(h, axis=1))


def _gru_batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, 16, (BATCH, 5)).astype(np.int32), rng.integers(0, 3, (BATCH,)).astype(
        np.int32
    )


def _gru_pair():
    torch.manual_seed(0)
    batches = [_gru_batch()]
    with pytest.warns(UserWarning, match="summed"):  # the mapping says it folds the biases
        return api.prepare_pair(_TorchGRU(), _FlaxGRU(), None, api._UserBatches(batches, None))


def _gru_gate_order(monkeypatch, pair):
    def edit(variables):  # torch's rows are r, z, n: a port that reads them as z, r, n
        cell = variables["params"]["GRUCell_0"]
        cell["ir"], cell["iz"] = cell["iz"], cell["ir"]
        cell["hr"], cell["hz"] = cell["hz"], cell["hr"]

    return _with_transfer(pair, edit)


def _resnet_padding(monkeypatch, pair):  # Flax "SAME" pads a stride-2 3x3 conv (0, 1)
    return _pair("resnet", wrong_port="padding")


def _resnet_biased_variance(monkeypatch, pair):  # flax.linen.BatchNorm's running variance
    return _pair("resnet", wrong_port="bn_variance")


# (name, model, mutation, the probe row that must name it)
MUTATIONS = [
    ("activation: tanh GELU for erf", "transformer", _gelu_tanh, "blocks.0.fc2 input"),
    ("LayerNorm epsilon 1e-6 for 1e-5", "transformer", _layernorm_eps, "blocks.0.ln1 output"),
    ("BatchNorm epsilon 1e-3 for 1e-5", "cnn_bn", _batchnorm_eps, "bn1 output"),
    ("BatchNorm momentum 0.01 for 0.1", "cnn_bn", _batchnorm_momentum, "bn2 running stats"),
    (
        "BatchNorm biased running variance",
        "resnet",
        _resnet_biased_variance,
        "stem_bn running stats",
    ),
    ("padding (0, 1) for (1, 1)", "resnet", _resnet_padding, "blocks.1.conv1 output"),
    ("missing ReLU", "mlp", _missing_relu, "fc2 input"),
    ("same-shape LayerNorms swapped", "transformer", _swapped_layernorms, "blocks.0.ln1 output"),
    ("dropped bias (attention out)", "transformer", _dropped_bias, "blocks.0.attn output"),
    ("attention scale 1 for 1/sqrt(d)", "transformer", _attention_scale, "blocks.0.attn output"),
    ("causal mask off", "transformer", _causal_mask_off, "blocks.0.attn output"),
    ("position offset", "transformer", _position_offset, "pos_embed input"),
    ("weight not transposed", "mlp", _untransposed_weight, "fc2 output"),
    ("LSTM gate order i/f swapped", "lstm", _lstm_gate_order, "lstm output"),
    ("LSTM hidden bias dropped", "lstm", _lstm_dropped_hidden_bias, "lstm output"),
    ("LSTM gate activation tanh for sigmoid", "lstm", _lstm_tanh_cell, "lstm output"),
    # the GRU cell runs inside nn.RNN's scan: its sequence is judged where it leaves (head input)
    ("GRU gate order r/z swapped", "gru", _gru_gate_order, "head input"),
]


# The correct ports pass the layer probe (and the GRU pair, whose mapping folds tensors, all of
# step 0 at fp32 and bf16-mixed); each mutation fails step 0 through `check_step0` and through a
# golden file, naming the row above: tests/parity/test_parity_golden_mutations.py, where the
# correct and the mutated pairs share their compiled programs.


# A mutation the probe catches fails bf16-mixed in its float32 stage, naming the layer, and the
# bf16-mixed stage is not reached: tests/parity/test_parity_golden_mutations.py (AT_BF16_MIXED).


def test_dropout_left_on_fails_naming_the_module():
    pair = _pair("transformer")
    pair.torch_model.blocks[0].attn.dropout = 0.5  # nn.MultiheadAttention's own dropout
    inputs, _ = _batch(pair)
    config = RunConfig(model="transformer", precision="bf16-mixed", batch_size=BATCH)
    verdict = stochastic_verdict(pair, config, inputs)
    assert verdict.passed is False and verdict.value == "blocks.0.attn"
    assert "blocks.0.attn" in verdict.detail
    # turned off by name, the same model is deterministic again
    assert dropout.disable_torch_dropout(pair.torch_model) == ["blocks.0.attn.dropout"]
    assert stochastic_verdict(pair, config, inputs).passed is True


# --- Hugging Face pairs (when transformers with its Flax classes is installed) -----------------


def _transformers():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxBertForSequenceClassification"):  # transformers 5: no Flax
        pytest.skip("this transformers has no Flax models")
    return transformers


def _bert_pair(dropout="disable", flax_act="gelu"):
    """Tiny BERT at Hugging Face's default init (initializer_range 0.02) and default dropouts."""
    transformers = _transformers()
    kwargs = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 16,
        "num_labels": 3,
    }
    torch.manual_seed(0)
    torch_model = transformers.BertForSequenceClassification(transformers.BertConfig(**kwargs))
    flax_config = transformers.BertConfig(**kwargs, hidden_act=flax_act)
    flax_model = hf_flax_model(
        transformers.FlaxBertForSequenceClassification, flax_config, weights="zeros"
    )
    rng = np.random.default_rng(0)
    # No token 0: torch's BertEmbeddings never trains its padding_idx row (gradient 0), Flax's
    # Embed does: a real difference of the two classes, not of this port.
    batch = (
        rng.integers(1, 64, (BATCH, 8)).astype(np.int32),
        rng.integers(0, 3, (BATCH,)).astype(np.int32),
    )
    pair = api.prepare_pair(
        torch_model,
        flax_model,
        None,
        api._UserBatches([batch], None),
        flax_kwargs=lambda x: {"token_type_ids": jnp.zeros_like(x), "head_mask": None},
        dropout=dropout,
    )
    return pair, batch


@pytest.mark.slow
@pytest.mark.standard_promotion  # Hugging Face Flax code mixes bool and int32
def test_bert_default_dropouts_turned_off_by_name_and_step0_passes():
    pair, batch = _bert_pair()
    attention = pair.torch_model.bert.encoder.layer[0].attention.self
    assert attention.dropout_prob == 0.0  # passed to SDPA as dropout_p: not an nn.Dropout
    config = RunConfig(model="bert", precision="fp32", batch_size=BATCH)
    result = check_step0(pair, config, batch)
    assert result.passed, result.summary()
    rows = {v.check: v for v in result.verdicts}
    assert rows[STOCHASTIC_CHECK].passed is True and rows[PROBE_CHECK].passed is True
    # left on, the same attribute is found and named
    attention.dropout_prob = 0.1
    verdict = stochastic_verdict(pair, config, batch[0])
    assert verdict.passed is False and "attention.self" in verdict.value
    with pytest.raises(adapters.AdapterError, match="dropout_prob"):
        _bert_pair(dropout="refuse")


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_bert_tanh_gelu_fails_the_probe_at_default_init():
    pair, batch = _bert_pair(flax_act="gelu_new")  # tanh approximation on the Flax side only
    probe = probe_layers(pair, batch[0])
    named = [f"{r['layer']} {r['kind']}" for r in probe.failed]
    assert "bert.encoder.layer.0.output.dense input" in named, named


# Hugging Face GPT-2 at bf16-true (its Flax code computes in float32: the cause is named, not a
# layer): tests/parity/test_parity_replay.py, beside the GPT-2 whose step-0 programs it shares.
