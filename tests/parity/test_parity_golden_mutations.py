"""The mutation catalogue through a golden file: `export` then `check` decide as compare_models;
and the catalogue's correct ports pass.

Every porting bug of tests/parity/test_parity_mutations.py, recorded with `export_golden` (torch's side:
outputs, gradients, the layer probe's inputs and outputs, the layer outputs the diagnosis reads)
and checked by `check_golden` (the JAX side, torch's read from the file), fails the same step-0
checks and names the same first diverging layer as `check_step0` (what `compare_models` runs)
on the same pair and batch. And Hugging Face GPT-2 ported with the exact (erf) GELU where GPT-2
uses the tanh one, which only the probe catches, FAILs through ``export_models`` + ``check`` as
through `compare_models`, naming the same layer. The correct ports of the catalogue pass the
layer probe (and the GRU pair all of step 0 at fp32 and bf16-mixed).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_flax import hf_flax_model  # noqa: E402
from test_parity_mutations import BATCH, MUTATIONS, _batch, _pair  # noqa: E402

from parity.core.config import RunConfig  # noqa: E402
from parity.golden.check import check_golden  # noqa: E402
from parity.golden.export import export_golden  # noqa: E402
from parity.golden.format import BatchList  # noqa: E402
from parity.verdicts import diagnose  # noqa: E402
from parity.verdicts.layer_probe import probe_layers  # noqa: E402
from parity.verdicts.step0 import check_step0  # noqa: E402
from parity.verdicts.step0_checks import PROBE_CHECK, STOCHASTIC_CHECK  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("one_torch_thread")]


# The probe is part of step 0's float32 stage at every precision: a mutation it catches fails a
# bf16-mixed run in that stage (whose rows are check_step0 at fp32's), and the bf16-mixed stage is
# not reached. One mutation of the catalogue runs at bf16-mixed to show it.
AT_BF16_MIXED = ("activation: tanh GELU for erf",)


# Flax "SAME" padding of a stride-2 3x3 conv: the first layer whose output leaves its band is
# named, every layer upstream of it agrees, and torch's step-0 passes run once.
NAMES_THE_CONV = ("padding (0, 1) for (1, 1)",)


def _ran_twice(*args, **kwargs):
    raise AssertionError("torch's step-0 passes ran twice")


def _step0_failures(verdicts) -> set[str]:
    return {v.check for v in verdicts if v.check.startswith("step 0") and v.passed is False}


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "model", "mutate", "caught_by"), MUTATIONS, ids=[m[0] for m in MUTATIONS]
)
def test_mutation_through_the_golden_decides_as_compare_models(
    tmp_path, monkeypatch, name, model, mutate, caught_by
):
    pair = mutate(monkeypatch, _pair(model))
    batch = _batch(pair)
    precision = "bf16-mixed" if name in AT_BF16_MIXED else "fp32"
    config = RunConfig(model=model, precision=precision, steps=1, batch_size=BATCH, eval=False)
    with monkeypatch.context() as patch:
        if name in NAMES_THE_CONV:  # the diagnosis reads torch's layers from step 0's passes
            patch.setattr(diagnose, "torch_layer_outputs", _ran_twice)
        harness = check_step0(pair, config, batch)
    assert not harness.passed, name
    if name in NAMES_THE_CONV:
        _assert_names_the_conv(harness)
    # the catalogue's row: the probe names the layer the mutation changed
    assert caught_by in {f"{r['layer']} {r['kind']}" for r in harness.probe.failed}, name
    if name in AT_BF16_MIXED:
        _assert_fails_in_the_float32_stage(harness)
    if name == "BatchNorm biased running variance":
        _assert_names_the_norm(harness)
    path = export_golden(tmp_path / "g.npz", config, pair=pair, stream=BatchList([batch]))
    result = check_golden(path, pair.flax_model)
    assert result.status == "FAIL", result.report()
    assert _step0_failures(result.verdicts) == _step0_failures(harness.verdicts), name
    if name in AT_BF16_MIXED:  # nor does the golden's check reach the bf16-mixed stage
        assert not any(v.check.startswith("step 0 bf16-mixed") for v in result.verdicts)
    if name == "BatchNorm biased running variance":  # the golden's train-mode row says why
        train_row = {v.check: v for v in result.verdicts}["step 0 fp32: train-mode output"]
        assert train_row.passed is False and "running stats" in train_row.detail
    step0 = result.runs[1]["step0"]
    assert caught_by in {f"{r['layer']} {r['kind']}" for r in step0["probe"]["failed"]}, name
    if harness.diagnosis is None:  # the per-layer table could not be made: nor here
        assert step0["diagnosis"] is None and step0["diagnosis_error"], name
        return
    diagnosis = step0["diagnosis"]
    named = (diagnosis["first_failing"], diagnosis["first_failing_stage"])
    assert named == (harness.diagnosis.first_failing, harness.diagnosis.first_failing_stage)
    assert diagnosis["first_failing_kind"] == harness.diagnosis.first_failing_kind
    assert diagnosis["first_failing_input"] == harness.diagnosis.first_failing_input
    assert harness.diagnosis.headline() in result.report(), result.report()


def _assert_names_the_conv(result) -> None:
    assert result.diagnosis_error is None
    failed = {v.check for v in result.verdicts if v.passed is False}
    assert "step 0 fp32: eval-mode output" in failed
    assert "step 0 fp32: gradients" in failed
    assert result.worst_output is not None and result.worst_parameter is not None
    # the stride-2 3x3 conv is the first layer whose output leaves its band
    assert result.diagnosis.first_failing == "blocks.1.conv1"
    assert result.diagnosis.first_failing_kind in ("eval output", "train output")
    assert "blocks.1.conv1" in result.summary()
    rows = {r["layer"]: r for r in result.diagnosis.rows}
    for layer in ("stem_conv", "stem_bn", "blocks.0.conv1", "blocks.0.conv2"):
        assert rows[layer]["eval output"] < rows[layer]["band"], layer  # upstream of the bug
    assert rows["blocks.1.conv1"]["eval output"] > 1e-2
    assert "**FIRST**" in result.diagnosis.to_markdown()


@pytest.mark.integration
@pytest.mark.slow
def test_cli_run_stops_a_wrong_port_at_step0(tmp_path, capsys):
    """`parity run` of the catalogue's wrongly padded resnet (its programs: the mutation's above)
    stops both frameworks at step 0, untrained, naming the conv."""
    from parity.cli import commands as cli
    from parity.core.records import load_results

    out = tmp_path / "wrong"
    args = ["run", "--model", "resnet", "--steps", "2", "--batch-size", str(BATCH), "--no-eval"]
    args += ["--model-override", 'wrong_port="padding"', "--model-override", "image_shape=[8,8,3]"]
    args += ["--model-override", "channels=[4,8,8]", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 1
    runs = load_results(out)["runs"]
    assert {r["framework"] for r in runs} == {"torch", "jax"}
    for run in runs:
        assert run["steps"] == []  # not trained
        assert "blocks.1.conv1" in run["summary"]["error"]
        assert run["step0"]["diagnosis"]["first_failing"] == "blocks.1.conv1"
    assert "first diverging layer: blocks.1.conv1" in capsys.readouterr().err


def _assert_fails_in_the_float32_stage(result) -> None:
    """The tanh GELU at bf16-mixed: hidden at the model's own init (the output rows pass), caught
    by the probe in the float32 stage; the bf16-mixed stage is not reached (a broken port is not
    compared in bf16)."""
    rows = {v.check: v for v in result.verdicts}
    assert rows["step 0 fp32: eval-mode output"].passed is True
    assert rows[PROBE_CHECK].passed is False
    assert "blocks.0.fc2 input" in rows[PROBE_CHECK].detail
    assert not any(check.startswith("step 0 bf16-mixed") for check in rows)
    assert result.diagnosis.first_failing == "blocks.0.fc2"
    # the GELU between fc1 and fc2 has no weights: fc2 agrees on torch's input, its input not
    assert "first divergence: the input of blocks.0.fc2" in result.summary()


def _assert_names_the_norm(result) -> None:
    """Flax's biased running variance: the forward pass and its gradient are right, the running
    statistics a train-mode pass leaves behind are not; the diagnosis and the probe name the
    first BatchNorm."""
    eval_row, train_row, grad_row = result.verdicts[:3]
    assert eval_row.passed and grad_row.passed  # the forward pass itself is right
    assert not train_row.passed and "running stats" in train_row.detail
    assert result.diagnosis.first_failing == "stem_bn"
    assert result.diagnosis.first_failing_kind == "running stats"
    # the probe sees it layer by layer too: the running variance of the first BatchNorm
    probe = {v.check: v for v in result.verdicts}["step 0 fp32: each layer on its operating range"]
    assert probe.passed is False
    assert "in execution order: stem_bn running stats" in probe.detail


# --- the correct ports of the catalogue: their programs are the mutated ports' (a mutation in the
# weight transfer changes values, not programs), compiled once in this file ---------------------


@pytest.mark.parametrize("model", ("mlp", "mlp_nnx", "cnn_bn", "lstm", "transformer", "gru"))
def test_correct_port_passes_the_layer_probe(model):
    pair = _pair(model)
    inputs, _ = _batch(pair)
    probe = probe_layers(pair, inputs)
    assert probe.rows and not probe.failed, [probe.describe(r) for r in probe.failed]
    # every layer was fed torch's input (the GRU cell runs inside a scan: judged at its output)
    assert set(probe.skipped) <= {"gru"}, probe.skipped
    worst = probe.worst
    assert worst["error"] <= worst["threshold"]


def test_correct_port_passes_step0_at_fp32_and_bf16_mixed():
    """The full step 0 of a correct pair (its other rows are older than the probe and tested in
    tests/parity/test_parity_step0.py): the GRU pair, whose mapping folds tensors. At bf16-mixed:
    its float32 stage runs first and is exactly what `check_step0` at fp32 computes (the same
    rows on the same batch), so one call decides both precisions."""
    pair = _pair("gru")
    config = RunConfig(model="gru", precision="bf16-mixed", batch_size=BATCH)
    result = check_step0(pair, config, _batch(pair))
    assert result.passed, result.summary()
    rows = {v.check: v for v in result.verdicts}
    fp32 = [v for v in result.verdicts if v.check.startswith(("step 0 fp32", "step 0:"))]
    assert len(fp32) >= 5 and all(v.passed is not False for v in fp32)  # check_step0(fp32)'s rows
    assert rows[PROBE_CHECK].passed is True and rows[STOCHASTIC_CHECK].passed is True
    # bf16 step-0 gradient bands may be too wide to decide (INCONCLUSIVE, never a failure)
    assert rows["step 0 bf16-mixed: gradients"].passed is not False
    assert rows["step 0 bf16-mixed: eval-mode output"].passed is True
    # forward-exact, but its mapping folds torch's two biases: said, not failed
    folded = rows["step 0: tensors folded by the mapping"]
    assert folded.passed is None
    assert "gru.bias_ih_l0 + gru.bias_hh_l0" in folded.detail
    assert "train differently" in folded.detail or "trajectories part" in folded.detail


# --- Hugging Face GPT-2 with the exact GELU (GPT-2 uses the tanh approximation) ---------------


def _gpt2_config(activation: str = "gelu_new"):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function=activation,
    )


def gpt2_exact_gelu():
    """The wrong port: Flax GPT-2 with ``gelu`` (erf) for GPT-2's ``gelu_new`` (tanh)."""
    import transformers

    return hf_flax_model(transformers.FlaxGPT2LMHeadModel, _gpt2_config("gelu"), weights="zeros")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.standard_promotion  # Hugging Face Flax code mixes bool and int32
def test_gpt2_exact_gelu_fails_the_golden_check_naming_the_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        pytest.skip("this transformers has no Flax models")
    import parity
    from parity.golden.export import export_models

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4, 17)).astype(np.int32)
    batches = [(tokens[:, :-1], tokens[:, 1:])]
    torch.manual_seed(0)
    torch_model = transformers.GPT2LMHeadModel(_gpt2_config())
    harness = parity.compare_models(torch_model, gpt2_exact_gelu(), batches=batches, task="lm")
    assert harness.status == "FAIL"
    expected = harness.runs[1]["step0"]["diagnosis"]["first_failing"]
    assert expected is not None
    path = export_models(
        tmp_path / "gpt2.npz",
        torch_model,
        "test_parity_golden_mutations:gpt2_exact_gelu",
        batches,
        task="lm",
    )
    result = check_golden(path)
    assert result.status == "FAIL" and result.exit_code == 1, result.report()
    rows = {v.check: v for v in result.verdicts}
    # the model's own init hides it (GPT-2's 0.02 init keeps GELU's input near 0): the probe
    assert rows["step 0 fp32: each layer on its operating range"].passed is False
    assert _step0_failures(result.verdicts) == _step0_failures(harness.verdicts)
    assert result.runs[1]["step0"]["diagnosis"]["first_failing"] == expected
    # GELU sits between c_fc and c_proj: c_proj agrees on torch's input, its input does not
    assert harness.runs[1]["step0"]["diagnosis"]["first_failing_input"], expected
    assert f"first divergence: the input of {expected}" in result.report()
