"""The harness's fp8 precisions: torchao's convert_to_float8_training (emulated on CPU) against
jaxamp.fp8 on the same model, layer by layer at step 0 and over a short run."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

import jaxamp.fp8  # noqa: E402
from parity.core import fp8 as pf  # noqa: E402
from parity.core.config import FP8_PRECISIONS, PRECISIONS, RunConfig  # noqa: E402
from parity.core.mx import MX_PRECISIONS  # noqa: E402
from parity.models import get_model_pair  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.standard_promotion]  # optax internals


def test_fp8_precisions_are_registered():
    # fp8 rows judge torchao's float8 recipes and the block-scaled ones with e4m3-like bands
    assert set(FP8_PRECISIONS) <= set(PRECISIONS)
    assert set(FP8_PRECISIONS) == set(pf.FP8_PRECISIONS) | set(MX_PRECISIONS)
    config = RunConfig(model="mlp", precision="fp8-rowwise-gw-hp")
    assert str(config.policy) == str(RunConfig(precision="fp32").policy)
    assert not config.mixed and not config.loss_scaling
    assert RunConfig.from_dict(config.to_dict()) == config
    assert pf.recipe_name("fp8-rowwise-gw-hp") == "rowwise_with_gw_hp"
    with pytest.raises(ValueError, match="fp8-rowwise"):
        RunConfig(precision="fp8-rowwse")
    with pytest.raises(ValueError, match="not fp8"):
        pf.recipe_name("bf16-mixed")


def _batch(pair):
    return pair.make_data(0, 8).batch(0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,precision",
    [
        ("mlp", "fp8-tensorwise"),
        ("mlp", "fp8-rowwise"),
        ("mlp", "fp8-rowwise-gw-hp"),
        # transformer at fp8-tensorwise: at the matrix's batch, below (its programs compiled once)
        ("transformer", "fp8-rowwise-gw-hp"),
        ("cnn", "fp8-tensorwise"),  # the fc's input features are permuted (NCHW vs NHWC flatten)
        ("mlp_nnx", "fp8-tensorwise"),  # flax.nnx pushes no name scope: layers found by weight
    ],
)
def test_step0_scales_and_fp8_codes_match_torchao(model, precision):
    pair = get_model_pair(model, seed=0)
    x, y = _batch(pair)
    rows = pf.step0_fp8(pair, precision, x, y)
    failed = [r for r in rows if not r["passed"]]
    assert not failed, failed
    # the quantizer itself is exact on identical tensors, every layer and tensor
    assert all(r["quantizer_exact"] for r in rows)
    # every converted layer was compared, input, weight and gradient each
    torch_layers = {r["torch_module"] for r in rows}
    assert len(rows) == 3 * len(torch_layers)
    want = {
        "mlp": {"fc1", "fc2", "fc3"},
        "mlp_nnx": {"fc1", "fc2", "fc3"},
        "cnn": {"fc"},
        "transformer": None,
    }[model]
    if want:
        assert torch_layers == want
    else:  # attention stays out on both sides (MultiheadAttention never calls out_proj.forward)
        assert all("attn" not in name for name in torch_layers) and "head" in torch_layers
    weights = [r for r in rows if r["tensor"] == "weight"]
    assert all(r["scales_equal"] and r["codes_differing"] == 0 for r in weights)
    if model in ("mlp", "mlp_nnx", "cnn"):  # no float32 reordering that matters upstream here
        assert all(r["max_code_steps"] <= 1 for r in rows)


@pytest.mark.slow
def test_step0_transformer_at_the_matrix_batch_judges_flips_downstream():
    # Batch 16 (the matrix's): a one-step flip at a rounding boundary in blocks.0.fc2's input
    # moves later layers' values near zero by tens of fp8 steps; those tensors are judged as
    # downstream of a flip, the quantizer stays exact on every tensor, and the first layer and
    # every weight stay exact.
    pair = get_model_pair("transformer", seed=0)
    x, y = pair.make_data(0, 16).batch(0)
    rows = pf.step0_fp8(pair, "fp8-tensorwise", x, y)
    assert all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    assert all(r["quantizer_exact"] for r in rows)
    # every converted layer was compared, input, weight and gradient each; attention stays out on
    # both sides (MultiheadAttention never calls out_proj.forward)
    torch_layers = {r["torch_module"] for r in rows}
    assert len(rows) == 3 * len(torch_layers)
    assert all("attn" not in name for name in torch_layers) and "head" in torch_layers
    assert torch_layers == {"blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "head"}
    weights = [r for r in rows if r["tensor"] == "weight"]
    assert all(r["exact_expected"] and r["scales_equal"] for r in weights)
    # upstream of the first flip every code is within one fp8 step
    assert all(r["max_code_steps"] <= 1 for r in rows if not r["downstream_of_flip"])
    first = [r for r in rows if r["torch_module"] == "blocks.0.fc1" and r["tensor"] == "input"]
    assert first[0]["codes_differing"] == 0 and not first[0]["downstream_of_flip"]
    assert all(r["codes_differing"] == 0 for r in rows if r["tensor"] == "weight")
    assert any(r["downstream_of_flip"] and r["max_code_steps"] > 1 for r in rows)


@pytest.mark.slow
def test_step0_catches_misaligned_features(monkeypatch):
    # Without the mapping's feature order the cnn's fc codes are compared in two orders: fails.
    pair = get_model_pair("cnn", seed=0)
    x, y = _batch(pair)
    monkeypatch.setattr(
        pf,
        "_feature_orders",
        lambda pair, module, shape: (np.arange(shape[0]), np.arange(shape[1])),
    )
    rows = pf.step0_fp8(pair, "fp8-tensorwise", x, y)
    weight = [r for r in rows if r["tensor"] == "weight"]
    assert weight and not any(r["passed"] for r in weight)


@pytest.mark.slow
def test_step0_catches_a_wrong_recipe(monkeypatch):
    pair = get_model_pair("mlp", seed=0)
    x, y = _batch(pair)
    monkeypatch.setattr(
        pf, "jax_recipe", lambda p, device=None: jaxamp.fp8.get_recipe("tensorwise", emulate=True)
    )
    rows = pf.step0_fp8(pair, "fp8-rowwise", x, y)
    assert any(not r["passed"] for r in rows)


@pytest.mark.integration
@pytest.mark.slow
def test_cli_fp8_run_passes_judged_by_the_fp8_layer_checks_and_a_wrong_recipe_stops_it(
    tmp_path, monkeypatch
):
    """`parity run` at fp8-tensorwise: step 0's run-precision rows are the per-layer fp8 checks
    (scales and codes; the generic output/gradient/compute-dtype rows would compare two float32
    models), a short run of torchao against jaxamp.fp8 passes the trajectory verdicts, and a JAX
    side that quantizes with another recipe is stopped at step 0. One run on mlp, batch 8, 4 steps,
    checks both the CLI's step 0 and the short run (its train step compiled once)."""
    from parity.cli import commands as cli
    from parity.core.records import load_results
    from parity.verdicts.judge import compare_runs

    def run(out):
        args = ["run", "--model", "mlp", "--precision", "fp8-tensorwise", "--steps", "4"]
        args += ["--batch-size", "8", "--no-eval", "--out", str(out), "--no-progress"]
        return cli.main(args)

    assert run(tmp_path / "good") == 0
    runs = load_results(tmp_path / "good")["runs"]
    step0 = runs[0]["step0"]
    assert step0["passed"] is True
    checks = [v["check"] for v in step0["verdicts"]]
    fp8_rows = [v for v in step0["verdicts"] if v["check"].startswith("step 0 fp8-tensorwise")]
    assert {v["check"] for v in fp8_rows} == {
        f"step 0 fp8-tensorwise: fp8 {t} scales and codes"
        for t in ("input", "weight", "grad_output")
    }, checks
    assert all(v["mode"] == "step 0" and "fc1, fc2, fc3" in v["detail"] for v in fp8_rows)
    assert any(c.startswith("step 0 fp32") for c in checks)  # the port itself, in float32
    assert not any(c.startswith("compute dtype") for c in checks)  # generic rows: not for fp8
    assert all(len(r["steps"]) == 4 for r in runs)
    # the short run: torchao's Float8Linear against jaxamp.fp8, judged like any cell
    torch_run, jax_run = sorted(runs, key=lambda r: r["framework"] != "torch")
    assert "torchao" in torch_run["fp8_method"] and torch_run["fp8_layers"] == ["fc1", "fc2", "fc3"]
    assert "jaxamp.fp8.convert" in jax_run["mixed_precision_method"]
    losses = [[s["loss"] for s in r["steps"]] for r in runs]
    assert np.all(np.isfinite(losses))
    verdicts = compare_runs([torch_run, jax_run])
    assert any("(fp8)" in v.check for v in verdicts), [v.check for v in verdicts]
    assert all(v.passed is not False for v in verdicts), [v for v in verdicts if v.passed is False]

    # the JAX side quantizes with another recipe (rowwise scales): step 0 stops the run
    monkeypatch.setattr(
        pf, "jax_recipe", lambda p, device=None: jaxamp.fp8.get_recipe("rowwise", emulate=True)
    )
    assert run(tmp_path / "wrong") == 1
    runs = load_results(tmp_path / "wrong")["runs"]
    for r in runs:
        assert r["steps"] == [] and r["step0"]["passed"] is False
        failed = [v for v in r["step0"]["verdicts"] if v["passed"] is False]
        assert failed and all(v["check"].startswith("step 0 fp8-tensorwise") for v in failed)
        assert "fc1" in r["summary"]["error"]
