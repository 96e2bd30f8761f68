"""Per-layer diagnosis (parity.verdicts.diagnose): layers matched through the mapping, first diverging layer.

Tiny MLPs (fp32); the resnet's wrongly padded conv is named in tests/parity/test_parity_golden_mutations.py.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from parity.core.config import RunConfig
from parity.models import get_model_pair
from parity.verdicts.diagnose import (
    KINDS,
    Diagnosis,
    _guess_flax_path,
    diagnose_config,
    diagnose_pair,
    diagnose_run,
    module_pairs,
)

TINY = {"image_shape": (4, 4, 3), "hidden": 8}


def _pair():
    return get_model_pair("mlp", seed=0, **TINY)


def _batch(pair):
    return pair.make_data(0, 4).batch(0)


def test_guessed_flax_paths_follow_flax_list_naming():
    assert _guess_flax_path("blocks.1.conv1") == ("blocks_1", "conv1")
    assert _guess_flax_path("fc") == ("fc",)
    assert _guess_flax_path("layers.0.0.attn") == ("layers_0_0", "attn")


def test_module_pairs_from_the_mapping_and_without_it():
    pair = _pair()
    variables = pair.torch_to_flax()
    mapped, unmatched = module_pairs(pair, variables)
    assert unmatched == []
    assert [t for t, _ in mapped] == ["fc1", "fc2", "fc3"]
    pair.mapping = None  # a user pair without a WeightMapping: the names are guessed
    guessed, unmatched = module_pairs(pair, variables)
    assert guessed == mapped and unmatched == []


@pytest.mark.slow
def test_correct_pair_has_no_diverging_layer():
    pair = _pair()
    diagnosis = diagnose_pair(pair, RunConfig(model="mlp", precision="fp32"), _batch(pair))
    assert diagnosis.first_failing is None
    assert [r["layer"] for r in diagnosis.rows] == ["fc1", "fc2", "fc3"]  # execution order
    for row in diagnosis.rows:
        assert row["passed"], row
        assert row["eval output"] < row["band"] / 10
        assert row["gradients"] < row["grad_band"] / 10
        assert row["running stats"] is None  # no BatchNorm
    assert "every layer within its band" in diagnosis.to_markdown()


@pytest.mark.slow
def test_first_diverging_layer_is_the_broken_one_and_the_table_is_json():
    pair = _pair()
    variables = pair.torch_to_flax()
    broken = jnp.asarray(variables["params"]["fc2"]["kernel"]) * 1.01  # a 1% transfer error
    variables["params"]["fc2"]["kernel"] = broken
    diagnosis = diagnose_pair(pair, "fp32", _batch(pair), variables=variables)
    assert diagnosis.first_failing == "fc2"
    assert diagnosis.first_failing_kind == "eval output"
    rows = {r["layer"]: r for r in diagnosis.rows}
    assert rows["fc1"]["eval output"] < rows["fc1"]["band"]  # upstream is fine
    assert 1e-3 < rows["fc2"]["eval output"] <= 0.0101  # the kernel's 1%, diluted by the bias
    text = diagnosis.to_markdown()
    assert "**FIRST**" in text and "`fc2`" in text
    for kind in KINDS:
        assert kind in text
    as_json = json.loads(json.dumps(diagnosis.to_dict()))
    assert as_json["first_failing"] == "fc2" and len(as_json["rows"]) == 3


def test_gradient_only_divergence_names_the_deepest_layer():
    rows = [
        {"layer": "a", "stage": "fp32", "failed_kinds": ["gradients"]},
        {"layer": "b", "stage": "fp32", "failed_kinds": ["gradients"]},
        {"layer": "c", "stage": "fp32", "failed_kinds": []},
    ]
    from parity.verdicts.layer_table import first_failing as _first_failing

    assert _first_failing(rows) == ("b", "fp32", "gradients")  # backward runs in reverse
    rows[0]["failed_kinds"] = ["running stats"]
    assert _first_failing(rows) == ("a", "fp32", "running stats")


@pytest.mark.slow
def test_diagnose_config_uses_the_run_batch():
    config = RunConfig(
        model="mlp",
        precision="fp32",
        batch_size=4,
        model_overrides={"image_shape": (4, 4, 3), "hidden": 8},
    )
    diagnosis = diagnose_config(config)
    assert isinstance(diagnosis, Diagnosis) and diagnosis.first_failing is None
    assert np.isfinite([r["eval output"] for r in diagnosis.rows]).all()
    from_record = diagnose_run({"config": config.to_dict()})  # what compare calls on a failure
    assert [r["eval output"] for r in from_record.rows] == [
        r["eval output"] for r in diagnosis.rows
    ]


@pytest.mark.slow
def test_diagnose_config_uses_the_run_data(monkeypatch):
    import parity.models

    built = []
    original = parity.models.get_model_pair

    def spy(*args, **kwargs):
        pair = original(*args, **kwargs)
        built.append((kwargs.get("data"), pair))
        return pair

    monkeypatch.setattr(parity.models, "get_model_pair", spy)
    config = RunConfig(model="mlp", data="digits", batch_size=4, model_overrides={"hidden": 8})
    diagnosis = diagnose_config(config)
    assert diagnosis.first_failing is None
    ((data, pair),) = built
    assert data == "digits"
    x, _ = pair.make_data(config.stream_seed, 4).batch(0)
    assert x.shape[1:] == (8, 8, 1)  # the digits images, not the synthetic task's


# --- broadcasting, shape rows and causes that are not a layer's ----------------------------------


def test_shaped_error_broadcasts_and_explains_shape_mismatches():
    from parity.verdicts.diagnose import shaped_error

    rng = np.random.default_rng(0)
    positions = rng.normal(size=(1, 5, 4))  # torch's (1, T, H) position embedding
    batch = np.broadcast_to(positions, (3, 5, 4)) * (1 + 1e-7)  # Flax's (B, T, H)
    error, note = shaped_error(batch, positions)
    assert 0 < error < 1e-6 and note == "torch (1, 5, 4) broadcast to flax (3, 5, 4)"
    error, note = shaped_error(np.ones((2, 3)), np.ones((2, 4)))
    assert error == float("inf") and note == "shapes differ: torch (2, 4), flax (2, 3)"
    assert shaped_error(np.ones(3), np.ones(3)) == (0.0, "")


def test_shape_rows_are_named_only_when_nothing_else_differs():
    from parity.verdicts.layer_table import first_failing as _first_failing

    rows = [
        {"layer": "pos", "stage": "fp32", "failed_kinds": ["shape"]},
        {"layer": "ln", "stage": "fp32", "failed_kinds": ["eval output"]},
    ]
    assert _first_failing(rows) == ("ln", "fp32", "eval output")
    rows[1]["failed_kinds"] = []
    assert _first_failing(rows) == ("pos", "fp32", "shape")


def test_explain_failure_names_non_layer_causes_and_the_probe_layer():
    from parity.verdicts.rows import Verdict
    from parity.verdicts.step0_checks import PROBE_CHECK, STOCHASTIC_CHECK, explain_failure

    def row(check, passed, value=0.0, detail="", kind=""):
        return Verdict(
            "m", "bf16-true", "cpu", check, "jax vs torch", value, 1.0, passed, detail, kind=kind
        )

    diagnosis = Diagnosis([], None)
    dtype = row(
        "compute dtype (jax)",
        False,
        0.0,
        "float32 100%; the run asked for bfloat16",
        "compute dtype",
    )
    explain_failure(diagnosis, [row("step 0 fp32: gradients", True), dtype], None)
    assert diagnosis.summary().startswith("cause: compute dtype (jax): float32 100%")

    diagnosis = Diagnosis([], None)
    stochastic = row(STOCHASTIC_CHECK, False, "bert.encoder.layer.0", kind="stochastic")
    explain_failure(diagnosis, [stochastic], None)
    assert diagnosis.cause == "stochastic torch modules: bert.encoder.layer.0"

    class Probe:
        rows = [
            {"layer": "fc1", "kind": "output", "passed": True, "mode": "eval", "scale": 1.0},
            {"layer": "fc2", "kind": "input", "passed": False, "mode": "eval", "scale": 1.0},
        ]

    diagnosis = Diagnosis([], None)
    explain_failure(diagnosis, [row(PROBE_CHECK, False, kind="layer probe")], Probe())
    assert diagnosis.first_failing == "fc2" and diagnosis.cause is None
    assert diagnosis.first_failing_kind.startswith("input on probe weights")
    assert diagnosis.first_failing_input
    assert diagnosis.summary().startswith("first divergence: the input of fc2 (")


def _table(*failed):
    """Diagnosis rows a, b, c in execution order; `failed`: {layer: kind}."""
    kinds = dict(failed)
    return [
        {"layer": name, "stage": "fp32", "failed_kinds": [kinds[name]] if name in kinds else []}
        for name in ("a", "b", "c")
    ]


def _probe(*failed):
    class Probe:
        rows = [
            {
                "layer": name,
                "kind": kind,
                "mode": "eval",
                "scale": 1.0,
                "passed": (name, kind) not in failed,
            }
            for name in ("a", "b", "c")
            for kind in ("output", "input")
        ]

    return Probe()


@pytest.mark.parametrize(
    "table, probe, headline",
    [
        # a weightless op before b: b agrees on torch's input, its own input does not
        ((("b", "eval output"),), (("b", "input"),), "first divergence: the input of b ("),
        # b itself (its output on torch's input differs): the table's own wording stays
        ((("b", "eval output"),), (("b", "output"),), "first diverging layer: b (eval output"),
        # gradients are named last-first (c); the probe's a runs first: a
        ((("c", "gradients"),), (("a", "output"),), "first diverging layer: a (output on probe"),
        # the table's forward divergence at a comes before the probe's at c: a
        ((("a", "eval output"),), (("c", "input"),), "first diverging layer: a (eval output"),
    ],
)
def test_the_headline_names_the_first_in_execution_order_and_says_input_of(table, probe, headline):
    from parity.verdicts.layer_table import first_failing as _first_failing
    from parity.verdicts.rows import Verdict
    from parity.verdicts.step0_checks import PROBE_CHECK, explain_failure

    rows = _table(*table)
    diagnosis = Diagnosis(rows, *(_first_failing(rows) or (None, None, None)))
    failed = Verdict(
        "m", "fp32", "cpu", PROBE_CHECK, "jax vs torch", 1.0, 0.1, False, kind="layer probe"
    )
    explain_failure(diagnosis, [failed], _probe(*probe))
    assert diagnosis.summary().startswith(headline), diagnosis.summary()


@pytest.mark.slow
def test_nnx_pair_diagnosis_names_the_broken_layer():
    pair = get_model_pair("mlp_nnx", seed=0, **TINY)
    variables = pair.torch_to_flax()
    variables["params"]["fc2"]["kernel"] = jnp.asarray(variables["params"]["fc2"]["kernel"]) * 1.01
    diagnosis = diagnose_pair(pair, "fp32", _batch(pair), variables=variables)
    assert diagnosis.first_failing == "fc2" and diagnosis.first_failing_kind == "eval output"
    rows = {r["layer"]: r for r in diagnosis.rows}
    assert rows["fc1"]["eval output"] < rows["fc1"]["band"]


# --- linen dropout: refused, naming each module and its rate ------------------------------------


@pytest.mark.torch
def test_an_active_linen_dropout_is_refused_naming_each_module_and_its_rate():
    """torch dropout is set to 0 in the harness's own copy; a linen module's rate and
    `deterministic` flag are its own code, so an active linen nn.Dropout is refused, naming
    every one (nested too) with its rate; one the harness can turn off is not."""
    import flax.linen as fnn
    import torch

    from parity import api
    from parity.pairs import adapters, dropout

    class Block(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.Dropout(0.3)(fnn.Dense(3)(x), deterministic=False)

    class Net(fnn.Module):
        @fnn.compact
        def __call__(self, x, train: bool = False):
            x = Block(name="block")(x)
            return fnn.Dense(2)(fnn.Dropout(0.5, deterministic=not train)(x))

    class Switchable(fnn.Module):  # takes `deterministic`: the harness passes True
        @fnn.compact
        def __call__(self, x, deterministic: bool = False):
            return fnn.Dense(2)(fnn.Dropout(0.5)(x, deterministic=deterministic))

    batches = api._UserBatches([(np.ones((4, 3), np.float32), np.zeros(4, np.int32))], None)
    torch_model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    with pytest.raises(adapters.AdapterError) as refused:
        api.prepare_pair(torch_model, Net(), None, batches)
    message = str(refused.value)
    assert "block/Dropout_0 (rate 0.3)" in message and "Dropout_0 (rate 0.5)" in message
    assert "deterministic" in message and "rate 0" in message
    assert dropout.linen_dropouts(Net(), jnp.ones((4, 3)), {"train": False}) == [
        "block/Dropout_0 (rate 0.3)"
    ]
    pair = api.prepare_pair(torch.nn.Linear(3, 2), Switchable(), None, batches)
    x = jnp.ones((4, 3))
    first, _ = pair.flax_apply(pair.torch_to_flax(), x, train=True)
    second, _ = pair.flax_apply(pair.torch_to_flax(), x, train=True)
    np.testing.assert_array_equal(first, second)
