"""The mutation catalogue through a golden file: `export` then `check` decide as compare_models.

Every porting bug of tests/parity/test_parity_mutations.py, recorded with `export_golden` (torch's side:
outputs, gradients, the layer probe's inputs and outputs, the layer outputs the diagnosis reads)
and checked by `check_golden` (the JAX side, torch's read from the file), fails the same step-0
checks and names the same first diverging layer as `check_step0` (what `compare_models` runs)
on the same pair and batch. And Hugging Face GPT-2 ported with the exact (erf) GELU where GPT-2
uses the tanh one, which only the probe catches, FAILs through ``export_models`` + ``check`` as
through `compare_models`, naming the same layer.
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
from parity.verdicts.step0 import check_step0  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.integration]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
    config = RunConfig(model=model, precision="fp32", steps=1, batch_size=BATCH, eval=False)
    harness = check_step0(pair, config, batch)
    assert not harness.passed, name
    # the catalogue's row: the probe names the layer the mutation changed
    assert caught_by in {f"{r['layer']} {r['kind']}" for r in harness.probe.failed}, name
    path = export_golden(tmp_path / "g.npz", config, pair=pair, stream=BatchList([batch]))
    result = check_golden(path, pair.flax_model)
    assert result.status == "FAIL", result.report()
    assert _step0_failures(result.verdicts) == _step0_failures(harness.verdicts), name
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

    return hf_flax_model(transformers.FlaxGPT2LMHeadModel, _gpt2_config("gelu"))


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
