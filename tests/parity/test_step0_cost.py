"""What step 0 runs once and reuses: torch's passes for the diagnosis (check_step0's diagnosis
without a second torch pass: test_parity_golden_mutations.py's wrong padding), float64 floors and the Flax
program across the probe's modes, and the probe's and step 0's examples bounded by the model's work
(parity.verdicts.layer_probe, step0_batch, diagnose, torch_side). Tiny models. (`python -m
parity` making torch's idle OpenMP threads sleep: tests/parity/test_parity_cli.py.)"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch

from parity.core.config import RunConfig
from parity.models import get_model_pair
from parity.verdicts import diagnose, layer_probe, probe_judge, step0_batch
from parity.verdicts.probe_judge import PROBE_EXAMPLES, PROBE_FLOPS, PROBE_MIN_EXAMPLES
from parity.verdicts.tolerance import forward_flops, program_shapes
from parity.verdicts.torch_side import layer_arrays, torch_side

TINY_RESNET = {"image_shape": (8, 8, 3), "channels": (4, 8, 16), "blocks_per_stage": 1}
TINY_TRANSFORMER = {"seq_len": 8, "d_model": 16, "num_heads": 2, "num_layers": 1}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _resnet(wrong_port: str = ""):
    return get_model_pair("resnet", seed=0, wrong_port=wrong_port, **TINY_RESNET)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_torch_side_keeps_the_layer_outputs_the_diagnosis_would_capture(precision):
    """The layer outputs kept from step 0's own eval and train passes are the ones a separate
    pair of passes gives (same modules, execution order, values), NCHW turned to NHWC."""
    pair = _resnet()
    inputs, targets = pair.make_data(0, 2).batch(0)
    config = RunConfig(model="resnet", precision=precision, batch_size=2)
    names = [name for name, _ in diagnose.module_pairs(pair, pair.torch_to_flax())[0]]
    side = torch_side(pair, inputs, targets, config, 1.0, trace_flops=False, layers=names)
    kept = tuple(layer_arrays(pair, captured) for captured in side.layers)
    again = diagnose.torch_layer_outputs(pair, names, inputs, config)
    for mine, theirs in zip(kept, again, strict=True):
        assert list(mine) == list(theirs) and len(mine) > 5
        for name in theirs:
            assert mine[name].shape == theirs[name].shape and mine[name].ndim in (2, 4)
            np.testing.assert_array_equal(mine[name], theirs[name])
    # nothing asked, nothing kept
    assert torch_side(pair, inputs, targets, config, 1.0, trace_flops=False).layers is None


def test_train_mode_floors_reuse_the_eval_ones_only_where_the_call_is_the_same(monkeypatch):
    """A layer called with the same inputs and giving the same output in both modes keeps its
    eval float64 floor (the same number a second float64 run gives); a BatchNorm, whose train
    call differs, is run in float64 again."""
    pair = _resnet()
    inputs, _ = pair.make_data(0, 4).batch(0)
    calls = []
    original = layer_probe._float64_floor

    def counted(module, entry, train):
        calls.append(train)
        return original(module, entry, train)

    monkeypatch.setattr(layer_probe, "_float64_floor", counted)
    reused = layer_probe.probe_torch(pair, inputs, scales=(1.0,))
    reused_calls = list(calls)
    calls.clear()
    monkeypatch.setattr(layer_probe, "_same_call", lambda a, b: False)
    fresh = layer_probe.probe_torch(pair, inputs, scales=(1.0,))
    floors = [
        (layer.name, layer.floor)
        for probe in (reused.scales[0], fresh.scales[0])
        for layer in probe.train.layers
    ]
    half = len(floors) // 2
    assert floors[:half] == floors[half:]  # the same floors, to the last bit
    assert reused_calls.count(True) < calls.count(True)  # fewer float64 runs in train mode
    assert 0 < reused_calls.count(True)  # the BatchNorms (and what follows them) ran again


def test_the_probe_compiles_one_flax_program_where_both_modes_are_the_same(monkeypatch):
    """The probe's Flax side compiles one program for eval and train mode where the two lower
    to the same program (the transformer: no dropout, no batch statistics), reused for every
    probe scale, and one per mode where they differ (a BatchNorm's train mode); the rows are
    those a program per mode gives, to the last bit."""
    compiled = []
    original = jax.stages.Lowered.compile

    def counted(self, *args, **kwargs):
        compiled.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    resnet = _resnet()
    record = layer_probe.probe_torch(resnet, resnet.make_data(0, 2).batch(0)[0], scales=(1.0,))
    probe_judge.judge_probe(resnet, record)
    assert len(compiled) == 2  # eval and train mode differ
    pair = get_model_pair("transformer", seed=0, **TINY_TRANSFORMER)
    record = layer_probe.probe_torch(pair, pair.make_data(0, 2).batch(0)[0])
    assert len(record.scales) == 2
    compiled.clear()
    shared = probe_judge.judge_probe(pair, record)
    assert len(compiled) == 1  # both modes, both scales
    compiled.clear()
    monkeypatch.setattr(probe_judge, "_same_program", lambda a, b: False)
    apart = probe_judge.judge_probe(pair, record)
    assert len(compiled) == 2
    assert shared.rows == apart.rows and len(shared.rows) > 4


def test_the_probe_examples_follow_the_models_work():
    pair = get_model_pair("transformer", seed=0, **TINY_TRANSFORMER)
    inputs, _ = pair.make_data(0, 16).batch(0)
    flops = forward_flops(pair, pair.torch_to_flax(), inputs)
    assert flops > 0
    assert layer_probe.probe_examples(pair, inputs, flops) == PROBE_EXAMPLES
    assert layer_probe.probe_examples(pair, inputs) == PROBE_EXAMPLES  # counted when not given
    assert layer_probe.probe_examples(pair, inputs[:3], flops) == 3  # never more than the batch
    per_example = PROBE_FLOPS / 3  # three examples fit
    assert layer_probe.probe_examples(pair, inputs, int(16 * per_example)) == 3
    huge = 16 * PROBE_FLOPS * 100
    assert layer_probe.probe_examples(pair, inputs, huge) == PROBE_MIN_EXAMPLES
    assert layer_probe.probe_examples(pair, inputs[:1], huge) == 1
    record = layer_probe.probe_torch(pair, inputs, scales=(1.0,), flops=int(16 * per_example))
    assert len(record.inputs) == 3
    np.testing.assert_array_equal(record.inputs, inputs[:3])


@pytest.mark.parametrize("model", ["mlp", "cnn", "cnn_bn", "lstm", "resnet", "transformer"])
def test_the_built_in_models_at_their_default_sizes_probe_and_compare_every_example(model):
    """The bounds change nothing the built-in models' verdicts were measured with: the probe
    runs on 8 examples, and step 0 compares the whole batch at every batch size the CLI and the
    matrix plans default to (32 at most; the README's main job: cnn on digits, less work than
    its default input, and the transformer at its default size)."""
    pair = get_model_pair(model, seed=0)
    inputs, _ = pair.make_data(0, PROBE_EXAMPLES).batch(0)
    flops = forward_flops(pair, pair.torch_to_flax(), inputs)
    assert flops * 2 < PROBE_FLOPS  # with room
    assert layer_probe.probe_examples(pair, inputs, flops) == PROBE_EXAMPLES
    batch = max(RunConfig(model=model).batch_size, 32)
    whole = flops * batch // PROBE_EXAMPLES  # matmul FLOPs grow with the examples
    assert whole * 2 < step0_batch.STEP0_FLOPS  # with room
    assert step0_batch.step0_examples(batch, whole) == batch


def test_step0_batch_bounds_the_examples_and_reads_the_bands_from_them(monkeypatch):
    # a context long enough that the weight gradients' contraction (examples x tokens) is the
    # longest of the program
    pair = get_model_pair("transformer", seed=0, **{**TINY_TRANSFORMER, "seq_len": 128})
    variables = pair.torch_to_flax()
    inputs, targets = pair.make_data(0, 4).batch(0)
    whole = step0_batch.step0_batch(pair, variables, inputs, targets)
    assert (whole.compared, whole.size, whole.bounded, whole.note()) == (4, 4, False, None)
    assert whole.inputs is inputs and whole.shapes == program_shapes(
        pair, variables, inputs, targets
    )
    monkeypatch.setattr(step0_batch, "STEP0_FLOPS", whole.flops // 2)  # two examples fit
    half = step0_batch.step0_batch(pair, variables, inputs, targets)
    assert (half.compared, half.size, half.bounded, half.flops) == (2, 4, True, whole.flops)
    np.testing.assert_array_equal(half.inputs, inputs[:2])
    np.testing.assert_array_equal(half.targets, targets[:2])
    # the gradients' batch-sized contractions: as long as the ones actually summed
    assert half.shapes == program_shapes(pair, variables, inputs[:2], targets[:2])
    assert half.shapes["grad"][0] < whole.shapes["grad"][0]
    assert "first 2 of 4 examples" in half.note()
    monkeypatch.setattr(step0_batch, "STEP0_FLOPS", 1)  # never under the minimum
    assert step0_batch.step0_examples(4, whole.flops) == step0_batch.STEP0_MIN_EXAMPLES
    assert step0_batch.step0_examples(1, whole.flops) == 1
    with pytest.raises(ValueError, match="size"):
        step0_batch.step0_examples(0, 1)


# A bounded step 0 says so and still names a wrong port: tests/parity/test_parity_step0.py, beside
# the correct resnet whose programs it runs.


def test_the_stochastic_check_reuses_torch_s_train_pass(monkeypatch):
    """Given the output of step 0's float32 train-mode call, one more call that repeats it
    exactly is the whole check; an output that differs (a dropout left on) is still named by the
    two hooked calls."""
    from parity.pairs import dropout
    from parity.verdicts import step0_checks

    pair = get_model_pair("transformer", seed=0, **TINY_TRANSFORMER)
    inputs, targets = pair.make_data(0, 4).batch(0)
    config = RunConfig(model="transformer", precision="bf16-mixed", batch_size=4)
    fp32 = dataclasses.replace(config, precision="fp32")
    reference = torch_side(pair, inputs, targets, fp32, 1.0, trace_flops=False).train_logits
    hooked = []
    original = dropout.torch_stochastic_modules

    def counted(*args):
        hooked.append(True)
        return original(*args)

    monkeypatch.setattr(step0_checks, "torch_stochastic_modules", counted)
    verdict = step0_checks.stochastic_verdict(pair, config, inputs, reference=reference)
    assert verdict.passed is True and verdict.value == "deterministic" and not hooked
    pair.torch_model.blocks[0].attn.dropout = 0.5  # left on
    torch.manual_seed(0)
    reference = torch_side(pair, inputs, targets, fp32, 1.0, trace_flops=False).train_logits
    verdict = step0_checks.stochastic_verdict(pair, config, inputs, reference=reference)
    assert verdict.passed is False and verdict.value == "blocks.0.attn" and hooked


@pytest.mark.integration
def test_a_golden_checks_the_examples_its_export_compared(tmp_path, monkeypatch):
    """A golden exported where step 0 was bounded records torch's step 0 on the batch's first
    examples; its check compares those, whatever the bound is when it runs."""
    from parity.cli.commands import main
    from parity.golden.check import check_golden

    path = tmp_path / "mlp.npz"
    export = "export --model mlp --precision fp32 --steps 2 --batch-size 4 --no-eval "
    export += "--model-override image_shape=[4,4,1] --model-override hidden=8 --no-progress --out"
    with monkeypatch.context() as patch:
        patch.setattr(step0_batch, "STEP0_FLOPS", 1)
        assert main([*export.split(), str(path)]) == 0
    result = check_golden(path)  # the bound back at its default: the whole batch would fit
    step0 = result.runs[1]["step0"]
    assert result.status == "PASS", result.report()
    assert step0["passed"] and step0["examples"] == {"compared": 2, "batch": 4}
    assert "first 2 of 4 examples" in step0["summary"]
