"""Hugging Face GPT-2 (torch and Flax from transformers 4.x), compared with no hand-written transfer.

Runs when `transformers` is installed (the `test` extra; CI installs it). Tiny config, random
init: nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "FlaxGPT2LMHeadModel"):  # transformers 5 dropped Flax
    pytest.skip("this transformers has no Flax models", allow_module_level=True)

from hf_flax import hf_flax_model  # noqa: E402

import parity  # noqa: E402
from parity import api  # noqa: E402
from parity.core.config import RunConfig  # noqa: E402
from parity.pairs import adapters  # noqa: E402
from parity.transfer import auto  # noqa: E402
from parity.verdicts.step0_checks import dropout_verdict  # noqa: E402

# Hugging Face Flax code mixes bool and int32 (no implicit promotion under strict mode).
pytestmark = [pytest.mark.slow, pytest.mark.standard_promotion]


def _gpt2(dropout: float = 0.0):
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=4,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    torch.manual_seed(0)
    # every pair takes the torch model's weights: the Flax model's own are never read
    return transformers.GPT2LMHeadModel(config), hf_flax_model(
        transformers.FlaxGPT2LMHeadModel, config, weights="zeros"
    )


def _batches(count=3, batch=4, length=16):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, 64, (batch, length + 1)).astype(np.int32)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def test_auto_maps_gpt2_with_tied_head_and_conv1d():
    torch_model, flax_model = _gpt2()
    mapping = auto(torch_model, flax_model)
    names = {e.torch_name: e for e in mapping.entries}
    assert "lm_head.weight" not in names  # tied to transformer.wte.weight: mapped once
    # HF Conv1D stores (in, out); FlaxConv1D (out, in): square c_proj follows the others.
    assert names["transformer.h.0.attn.c_proj.weight"].transform == "linear"
    assert names["transformer.h.0.mlp.c_fc.weight"].transform == "linear"
    assert len(mapping.entries) == len(list(torch_model.parameters()))


@pytest.mark.integration
def test_gpt2_pair_compares_in_a_few_lines():
    torch_model, flax_model = _gpt2()
    result = parity.compare_models(torch_model, flax_model, batches=_batches(), task="lm")
    assert result.passed, [(v.check, v.value, v.passed) for v in result.verdicts]
    torch_losses = [s["loss"] for s in result.runs[0]["steps"]]
    jax_losses = [s["loss"] for s in result.runs[1]["steps"]]
    # float32 on both sides: the same weights, batches and AdamW steps agree to rounding.
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-5)


def test_gpt2_dropout_is_disabled_on_both_sides_or_refused():
    torch_model, flax_model = _gpt2(dropout=0.1)
    with pytest.raises(adapters.AdapterError, match="dropout"):
        parity.compare_models(
            torch_model, flax_model, batches=_batches(1), task="lm", dropout="refuse", steps=1
        )
    pair = api.prepare_pair(
        torch_model, flax_model, None, api._UserBatches(_batches(1), None), task="lm"
    )
    assert pair.torch_model.config.resid_pdrop == 0.0
    assert torch_model.config.resid_pdrop == 0.1  # the user's model is untouched
    assert dropout_verdict(pair, RunConfig(model="user_model", precision="fp32")) is None
    # a port configured with other rates (Flax 0.3, torch 0.1): turned off, untested, named
    other = hf_flax_model(
        transformers.FlaxGPT2LMHeadModel,
        transformers.GPT2Config(**{**flax_model.config.to_dict(), "resid_pdrop": 0.3}),
        weights="zeros",
    )
    pair = api.prepare_pair(
        torch_model, other, None, api._UserBatches(_batches(1), None), task="lm"
    )
    row = dropout_verdict(pair, RunConfig(model="user_model", precision="fp32"))
    assert row.passed is None and row.mode == "informational"
    assert row.detail.startswith("config.resid_pdrop: torch 0.1, Flax 0.3: ")


def test_gpt2_classification_task_is_refused_with_the_fix():
    torch_model, flax_model = _gpt2()
    with pytest.raises(ValueError, match="task='lm'"):
        parity.compare_models(torch_model, flax_model, batches=_batches(1), steps=1)
