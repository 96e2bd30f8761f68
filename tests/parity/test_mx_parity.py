"""The harness's MX precisions: torchao's mx_mm layers (emulated on CPU) against jaxamp.mx on the
same model, every layer's scales and element codes at step 0; planted wrong scale mode and wrong
block axis on the JAX side fail there."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")

import jaxamp.mx  # noqa: E402
from parity.core import mx as pm  # noqa: E402
from parity.core.config import PRECISIONS, RunConfig  # noqa: E402
from parity.core.recipes import get_recipe  # noqa: E402
from parity.models import get_model_pair  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.standard_promotion]  # optax internals


def _small_mlp():
    # fc1 192 -> 64, fc2 64 -> 64 (both blockable), fc3 64 -> 10 (not: stays float32)
    pair = get_model_pair("mlp", seed=0, image_shape=(8, 8, 3), hidden=64)
    x, y = pair.make_data(0, 32).batch(0)
    return pair, x, y


def test_mx_precisions_are_registered():
    assert set(pm.MX_PRECISIONS) <= set(PRECISIONS)
    recipe = get_recipe("mxfp8")
    assert recipe.compute_dtype_name == "float8" and recipe.matrix_plan["batch_size"] == 32
    assert "MXFP8Linear(scale_calculation_mode=RCEIL)" in recipe.torch_method()
    assert "jaxamp.mx.convert(recipe='mxfp8', emulate=True)" in recipe.jax_method("cpu")
    assert (
        get_recipe("mxfp8").unsupported("ddp") and get_recipe("mxfp8").unsupported("single") is None
    )
    with pytest.raises(ValueError, match="mxfp8"):
        RunConfig(precision="mxfp9")
    with pytest.raises(ValueError, match="not block-scaled"):
        pm.recipe_name("fp8-rowwise")


@pytest.mark.parametrize("precision", ["mxfp8", "mxfp8-floor", "mxfp8-wgrad-hp", "mxfp4"])
def test_step0_scales_and_codes_match_torchao(precision):
    pair, x, y = _small_mlp()
    rows = pm.step0_mx(pair, precision, x, y)
    assert not [r for r in rows if not r["passed"]], rows
    assert {r["torch_module"] for r in rows} == {"fc1", "fc2"}  # fc3 (10 outputs) is not blocked
    assert all(r["quantizer_exact"] for r in rows) and len(rows) == 6
    # mlp: no float32 reordering upstream that moves a code: every tensor bit-identical
    assert all(r["scales_equal"] and r["codes_differing"] == 0 for r in rows)
    both = 2 if precision != "mxfp8-wgrad-hp" else 1  # each tensor feeds two matmuls
    fc2_in = next(r for r in rows if r["torch_module"] == "fc2" and r["tensor"] == "input")
    assert fc2_in["codes"] == both * 32 * 64


@pytest.mark.slow
def test_step0_transformer_judges_flips_downstream():
    # float32 summation order flips a few codes (blocks.1.fc1's input); everything computed
    # after carries it through block-scaled matmuls. The quantizer stays exact on every tensor,
    # every weight and the first layer's input stay bit-identical.
    pair = get_model_pair("transformer", seed=0)
    x, y = pair.make_data(0, 32).batch(0)
    rows = pm.step0_mx(pair, "mxfp8", x, y)
    assert all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert all(r["quantizer_exact"] for r in rows)
    assert all(r["codes_differing"] == 0 for r in rows if r["tensor"] == "weight")
    first = next(r for r in rows if r["torch_module"] == "blocks.0.fc1" and r["tensor"] == "input")
    assert first["codes_differing"] == 0 and not first["downstream_of_flip"]
    assert {r["torch_module"] for r in rows} >= {"blocks.0.fc1", "blocks.1.fc2", "head"}


def test_torch_side_keeps_the_bias_and_parameters():
    import torch

    pair, _, _ = _small_mlp()
    model = pair.torch_model
    before = {n: p for n, p in model.named_parameters()}
    import copy

    converted = copy.deepcopy(model)
    layers = pm.convert_torch(converted, "mxfp8", "cpu")
    assert layers == ["fc1", "fc2"] and type(converted.fc1).__name__ == "MXFP8Linear"
    assert type(converted.fc3) is torch.nn.Linear
    assert [n for n, _ in converted.named_parameters()] == list(before)
    x = torch.zeros(32, 8, 8, 3)
    # zero input: the output is the bias chain exactly (torchao's quantize_ path drops it)
    np.testing.assert_allclose(
        converted(x).detach().numpy(), model(x).detach().numpy(), rtol=0.07, atol=1e-6
    )


def test_models_without_blockable_layers_are_not_applicable():
    # cnn: its only linear layer has 10 outputs. Both sides say so; nothing runs as float32
    # under an MX name.
    import jax.numpy as jnp

    from parity.core.hardware import UnsupportedHere

    pair = get_model_pair("cnn", seed=0)
    x, y = pair.make_data(0, 32).batch(0)
    assert pm.step0_mx(pair, "mxfp8", x, y) is None
    with pytest.raises(UnsupportedHere, match="multiples of 32"):
        get_recipe("mxfp8").torch_convert(pair.torch_model, "cpu")
    forward = pm.wrap_jax_forward(lambda x, w: x @ w, "mxfp8", "cpu")
    with pytest.raises(UnsupportedHere, match="multiples of 32"):
        forward(jnp.ones((32, 64)), jnp.ones((64, 10)))


# --- planted faults on the JAX side fail at step 0 ---------------------------------------------


def test_planted_wrong_scale_mode_fails_step0(monkeypatch):
    # the JAX port rounds scales down (FLOOR) where torchao's op rounds up (RCEIL)
    pair, x, y = _small_mlp()
    real = pm.jax_recipe
    monkeypatch.setattr(
        pm, "jax_recipe", lambda p, device=None: real(p, device).with_scale_mode("floor")
    )
    rows = pm.step0_mx(pair, "mxfp8", x, y)
    assert not any(r["quantizer_exact"] for r in rows if r["tensor"] == "weight")
    assert any(not r["passed"] for r in rows)


def test_planted_wrong_block_axis_fails_step0(monkeypatch):
    # the JAX port blocks the weight along its output features in the forward matmul
    pair, x, y = _small_mlp()
    real = jaxamp.mx.Recipe.operands

    def wrong(self):
        ops = real(self)
        ops["weight"] = (ops["weight"][0], "N")
        return ops

    monkeypatch.setattr(jaxamp.mx.Recipe, "operands", wrong)
    rows = pm.step0_mx(pair, "mxfp8", x, y)
    weights = [r for r in rows if r["tensor"] == "weight"]
    assert weights and not any(r["passed"] or r["quantizer_exact"] for r in weights)
    assert all("blocks differ" in r["detail"] for r in weights if r["torch_module"] == "fc1")


def test_features_in_another_order_fail_step0(monkeypatch):
    # a layer whose inputs are permuted between the sides (cnn's NCHW/NHWC flatten): its blocks
    # hold other elements, which no reordering of codes can hide
    pair, x, y = _small_mlp()
    orders = pm._feature_orders

    def permuted(pair, module, shape):
        i, o = orders(pair, module, shape)
        return (i[::-1], o) if module == "fc2" else (i, o)

    monkeypatch.setattr(pm, "_feature_orders", permuted)
    rows = pm.step0_mx(pair, "mxfp8", x, y)
    assert [r["passed"] for r in rows if r["torch_module"] == "fc2"] == [False] * 3
    assert all(r["passed"] for r in rows if r["torch_module"] == "fc1")


@pytest.mark.integration
def test_short_mx_run_passes_verdicts():
    from parity.training.train_jax import train_jax
    from parity.training.train_torch import train_torch
    from parity.verdicts.judge import compare_runs

    pair, _, _ = _small_mlp()
    config = RunConfig(model="mlp", precision="mxfp8", steps=4, batch_size=32, eval=False)
    runs = [train_torch(config, pair), train_jax(config, pair)]
    assert runs[0]["fp8_layers"] == ["fc1", "fc2"]
    assert "jaxamp.mx.convert" in runs[1]["mixed_precision_method"]
    verdicts = compare_runs(runs)
    assert any("(fp8)" in v.check for v in verdicts)
    assert all(v.passed is not False for v in verdicts), [v for v in verdicts if v.passed is False]
